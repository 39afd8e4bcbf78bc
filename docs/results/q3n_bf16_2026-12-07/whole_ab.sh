#!/bin/bash
# Whole-run A/B for qwen3-next-200m in bfloat16 (and float32 with DTS="bfloat16 float32"): main
# (checked out at $OLD: git worktree add --detach $OLD 60137c6) and this checkout alternated in
# separate processes, ROUNDS rounds, the order swapped every round; wall and thread CPU per
# LLM.generate of 32 x (128 -> 128) greedy (run32.py, first run: no prefix-cache hits), one
# thread. Kernel caches: $OLD_CACHE and $NEW_CACHE.
OLD=${OLD:-/tmp/q3nbf16-main}
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
R32=$NEW/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
one() {  # one NAME TREE CACHE DT
  echo "$1 $(DT=$4 PYTHONPATH=$2 PAGEDLLM_KERNEL_CACHE=$3 $PY $R32 qwen3-next-200m 128 1 2>/dev/null | tail -1) $4 load $(cut -d' ' -f1 /proc/loadavg)"
}
for R in $(seq 1 ${ROUNDS:-2}); do
  for DT in ${DTS:-bfloat16}; do
    if [ $((R % 2)) = 1 ]; then
      one "round $R main" $OLD ${OLD_CACHE:-$OLD-kernels} $DT; one "round $R branch" $NEW ${NEW_CACHE:-$NEW-kernels} $DT
    else
      one "round $R branch" $NEW ${NEW_CACHE:-$NEW-kernels} $DT; one "round $R main" $OLD ${OLD_CACHE:-$OLD-kernels} $DT
    fi
  done
done
