#!/bin/bash
# `pagedllm bench throughput --compare hf`, 32 x (128 -> 128), one thread, per preset and dtype.
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 PAGEDLLM_KERNEL_CACHE=/tmp/moe-kernels PYTHONPATH=/work/wt-moe
cd /work/wt-moe
for dt in bfloat16 float32; do
  for preset in deepseek-v2-lite-200m qwen3-next-200m; do
    echo "== $preset $dt load $(cut -d' ' -f1-3 /proc/loadavg)"
    timeout 900 /work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench throughput --preset $preset \
      --dtype $dt --num-prompts 32 --input-len 128 --output-len 128 --compare hf \
      --output-json /tmp/moe/bench_${preset}_${dt}.json 2>&1 | grep -v -i "warn" | tail -8
  done
done
