#!/bin/bash
# bench throughput --compare hf, 32 x (128 -> 128), one thread: branch (rebased on main 72dd531) and main alternated, bf16.
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 PAGEDLLM_KERNEL_CACHE=/tmp/moe-kernels
for spec in "wt-moe qwen3-next-200m" "main deepseek-v2-lite-200m" "wt-moe deepseek-v2-lite-200m"; do
  set -- $spec
  echo "== $1 $2 bfloat16 load $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd /work/$1 && PYTHONPATH=/work/$1 timeout 900 /work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench throughput --preset $2 \
    --dtype bfloat16 --num-prompts 32 --input-len 128 --output-len 128 --compare hf \
    --output-json /tmp/moe/bench2_$1_$2_bfloat16.json 2>&1 | grep -E "output_tokens_per_s|greedy|machine")
done
