# Whole-run A/B: main (b898fcf, $OLD with its kernels in $OLD_KERNELS) and this branch
# alternated in separate processes; wall and thread CPU per LLM.generate of 32 x (128 -> 128)
# greedy on deepseek-v2-lite-200m (docs/results/b32_dtypes_2026-12-07/run32.py), one thread.
OLD=${OLD:-/work/main}; OLD_KERNELS=${OLD_KERNELS:-/tmp/mla-kernels-main}
NEW=$(cd "$(dirname "$0")/../../.." && pwd); NEW_KERNELS=${NEW_KERNELS:-/tmp/mla-kernels}
R32=$NEW/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PY:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
cd /tmp
for R in 1 2; do
for DT in float32 bfloat16; do
  echo "round $R main   $(DT=$DT PYTHONPATH=$OLD PAGEDLLM_KERNEL_CACHE=$OLD_KERNELS $PY $R32 deepseek-v2-lite-200m 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1 /proc/loadavg)"
  echo "round $R branch $(DT=$DT PYTHONPATH=$NEW PAGEDLLM_KERNEL_CACHE=$NEW_KERNELS $PY $R32 deepseek-v2-lite-200m 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1 /proc/loadavg)"
done; done
