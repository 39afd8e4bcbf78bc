#!/bin/bash
# Whole runs, main (MAIN: a checkout of main with its kernels in their own cache) and this
# branch alternated in separate processes, the order swapped each round: wall and thread CPU
# seconds of LLM.generate, 32 x (128 -> 128) greedy (run32.py), one thread.
# usage: whole_ab.sh [PRESET] [DTYPE] [ROUNDS]
P=${1:-deepseek-v2-lite-200m}; DT=${2:-float32}; N=${3:-3}
MAIN=${MAIN:-/work/main}
TREE=$(cd "$(dirname "$0")/../../.." && pwd)
R32=$TREE/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PY:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 DT
run() {   # run LABEL TREE KERNEL_CACHE
  out=$(PYTHONPATH=$2 PAGEDLLM_KERNEL_CACHE=$3 $PY $R32 $P 128 1 2>/dev/null | tail -1)
  echo "round $R $1 $out $DT load $(cut -d' ' -f1 /proc/loadavg) $(date -u +%H:%M)"
}
for R in $(seq $N); do
  if [ $((R % 2)) = 1 ]; then
    run main $MAIN ${MAIN_CACHE:-/tmp/moedec-main-kernels}; run branch $TREE ${BRANCH_CACHE:-/tmp/moedec-kernels}
  else
    run branch $TREE ${BRANCH_CACHE:-/tmp/moedec-kernels}; run main $MAIN ${MAIN_CACHE:-/tmp/moedec-main-kernels}
  fi
done
