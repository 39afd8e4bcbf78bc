#!/bin/bash
# Whole runs (32 prompts x 128 -> 128, one LLM.generate per process) main vs branch alternated,
# float32 and bfloat16, both presets; one thread. Prints wall and engine-thread CPU seconds.
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 PAGEDLLM_KERNEL_CACHE=/tmp/moe-kernels
for round in 1 2; do
  for dt in bfloat16 float32; do
    for preset in deepseek-v2-lite-200m qwen3-next-200m; do
      for tree in main wt-moe; do
        out=$(cd /work/$tree && DT=$dt PYTHONPATH=/work/$tree timeout 600 /work/main/.venv/bin/python "$(dirname "$(readlink -f "$0")")"/run32.py $preset 128 1 2>/dev/null | tail -1)
        echo "round $round $tree $dt $out load $(cut -d' ' -f1 /proc/loadavg)"
      done
    done
  done
done
