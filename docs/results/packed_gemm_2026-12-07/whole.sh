#!/bin/bash
# Whole runs (run32.py: one LLM.generate of 32 x (128 -> 128), thread CPU seconds), main's
# checkout and the gemm branch's worktree alternated, one process per run, one thread; each
# side with its own kernel cache.
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
for round in 1 2; do
 for P in ${PRESETS:-deepseek-v2-lite-200m qwen3-next-200m}; do
  for DT in ${DTS:-float32 bfloat16}; do
   DT=$DT TAG=main PAGEDLLM_KERNEL_CACHE=/tmp/gemm-main-kernels nice -n 0 /work/main/.venv/bin/python /tmp/gemm/run32.py $P 128 2>/dev/null
   DT=$DT TAG=gemm PYTHONPATH=/work/wt-gemm PAGEDLLM_KERNEL_CACHE=/tmp/gemm-kernels nice -n 0 /work/main/.venv/bin/python /tmp/gemm/run32.py $P 128 2>/dev/null
  done
 done
done
