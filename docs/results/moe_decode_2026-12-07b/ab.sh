#!/bin/bash
# Builds ab.cpp against two source trees of csrc/ (OLD: e.g. main's, from
#   git archive 60137c6 pagedllm/native/kernels/csrc | tar -x -C $OLD --strip-components=4
# NEW: this checkout's) and runs it: ab.sh [rounds]. B: the build directory.
D=$(cd "$(dirname "$0")" && pwd)
NEW=${NEW:-$D/../../../pagedllm/native/kernels/csrc}
OLD=${OLD:-/tmp/moedec-old}
B=${B:-/tmp/moedec-ab}; mkdir -p $B
F="-O3 -march=native -fopenmp -std=c++17"
g++ $F -Dpagedllm=pagedllm_old -DVARIANT_FN=moe_old -I$OLD -c $D/moe_tu.cpp -o $B/old.o &
g++ $F $NEWFLAGS -Dpagedllm=pagedllm_new -DVARIANT_FN=moe_new -I$NEW -c $D/moe_tu.cpp -o $B/new.o &
g++ $F -c $D/ab.cpp -o $B/main.o & wait
g++ $F $B/main.o $B/old.o $B/new.o -o $B/ab || exit 1
OMP_NUM_THREADS=1 $B/ab "$@"
echo "load $(cut -d' ' -f1-3 /proc/loadavg)  $(date -u +%H:%M)"
