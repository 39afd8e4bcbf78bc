#!/bin/bash
# Whole runs: the starting point (b898fcf, checked out at $OLD with its kernels in their own
# cache) and this checkout alternated in separate processes, float32, one thread; wall and
# thread CPU seconds per LLM.generate of 32 x (128 -> 128) greedy (run32.py of
# docs/results/b32_dtypes_2026-12-07). usage: whole_ab.sh [ROUNDS]
OLD=${OLD:-/tmp/moe-old}   # git worktree add --detach $OLD b898fcf
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
R32=$NEW/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PY:-/work/main/.venv/bin/python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 DT=float32
for R in $(seq 1 ${1:-2}); do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
  echo "round $R old $(PYTHONPATH=$OLD PAGEDLLM_KERNEL_CACHE=$OLD-kernels $PY $R32 $P 128 1 2>/dev/null | tail -1) load $(cut -d' ' -f1 /proc/loadavg)"
  echo "round $R new $(PYTHONPATH=$NEW PAGEDLLM_KERNEL_CACHE=${NEW_CACHE:-/tmp/moe-kernels} $PY $R32 $P 128 1 2>/dev/null | tail -1) load $(cut -d' ' -f1 /proc/loadavg)"
done; done
