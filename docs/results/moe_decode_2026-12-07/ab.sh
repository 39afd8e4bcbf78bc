#!/bin/bash
# Builds ab_probe from two source trees of csrc/ (OLD: a copy of the starting point's csrc, NEW:
# this checkout's) and runs it: ab.sh deepseek|qwen decode|prefill [rounds]
# NEWFLAGS: extra compiler flags for the new build only (the -D switches of the variants tried);
# LAYERS: the decode layer count (ab_probe.cpp); B: the build directory. OLD: e.g.
#   git archive b898fcf pagedllm/native/kernels/csrc | tar -x -C DIR --strip-components=4
D=$(cd "$(dirname "$0")" && pwd)
NEW=${NEW:-$D/../../../pagedllm/native/kernels/csrc}
OLD=${OLD:-/tmp/moe-probe/old_csrc}
B=${B:-/tmp/moe-probe/build}; mkdir -p $B
F="-O3 -march=native -fopenmp -std=c++17"
g++ $F -Dpagedllm=pagedllm_old -DVARIANT_FN=moe_old -I$OLD -c $D/moe_tu.cpp -o $B/old.o &
g++ $F $NEWFLAGS -Dpagedllm=pagedllm_new -DVARIANT_FN=moe_new -I$NEW -c $D/moe_tu.cpp -o $B/new.o &
g++ $F -c $D/ab_probe.cpp -o $B/main.o & wait
g++ $F $B/main.o $B/old.o $B/new.o -o $B/ab_probe || exit 1
OMP_NUM_THREADS=1 $B/ab_probe "$@"
echo "load $(cut -d' ' -f1-3 /proc/loadavg)  $(date -u +%H:%M)"
