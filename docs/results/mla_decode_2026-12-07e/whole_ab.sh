#!/bin/bash
# Whole runs: main (its checkout at $OLD, kernels in $OLD_KERNELS) against this checkout,
# alternated in separate processes, order swapped each round; deepseek-v2-lite-200m float32,
# 32 x (128 -> 128) greedy (run32.py), one thread; wall and thread CPU per LLM.generate.
OLD=${OLD:-/work/main}; OLD_KERNELS=${OLD_KERNELS:-/tmp/mladec-mainkernels}
NEW=$(cd "$(dirname "$0")/../../.." && pwd); NEW_KERNELS=${NEW_KERNELS:-/tmp/mladec-kernels}
R32=$NEW/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 DT=float32
run() { PYTHONPATH=$2 PAGEDLLM_KERNEL_CACHE=$3 nice -n 5 $PY $R32 deepseek-v2-lite-200m 128 1 2>/dev/null | tail -1; }
for R in $(seq ${ROUNDS:-3}); do
  if [ $((R % 2)) = 1 ]; then order="main branch"; else order="branch main"; fi
  for w in $order; do
    if [ $w = main ]; then out=$(run x $OLD $OLD_KERNELS); else out=$(run x $NEW $NEW_KERNELS); fi
    echo "round $R $w $out load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
