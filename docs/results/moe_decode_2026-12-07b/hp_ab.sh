#!/bin/bash
# Whole runs with the experts on 2 MiB pages (PAGEDLLM_CPU_HUGE_PAGES=1, the default) and on
# torch's 4 KiB pages (=0), same build, alternated in separate processes: wall and thread CPU
# seconds of LLM.generate, 32 x (128 -> 128) greedy (run32.py), one thread.
# usage: hp_ab.sh [PRESET] [DTYPE] [ROUNDS]
P=${1:-deepseek-v2-lite-200m}; DT=${2:-float32}; N=${3:-3}
TREE=$(cd "$(dirname "$0")/../../.." && pwd)
R32=$TREE/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PY:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 DT
for R in $(seq $N); do
  for HP in $([ $((R % 2)) = 1 ] && echo "0 1" || echo "1 0"); do
    out=$(PAGEDLLM_CPU_HUGE_PAGES=$HP PYTHONPATH=$TREE $PY $R32 $P 128 1 2>/dev/null | tail -1)
    echo "round $R huge_pages=$HP $out $DT load $(cut -d' ' -f1 /proc/loadavg) $(date -u +%H:%M)"
  done
done
