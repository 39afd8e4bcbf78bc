# Prefill-only A/B: as ab.sh with OUTPUT_LEN 1 (the 32 x 128 prompts' two 2048-token prefill
# steps and one sampled token each), float32 then bfloat16, $ROUNDS rounds.
OLD=${OLD:-/work/main}; OLD_KERNELS=${OLD_KERNELS:-/tmp/mla-kernels-main}
NEW=$(cd "$(dirname "$0")/../../.." && pwd); NEW_KERNELS=${NEW_KERNELS:-/tmp/mla-kernels}
R32=$NEW/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PY:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
cd /tmp
for R in $(seq 1 ${ROUNDS:-3}); do
for DT in ${DTS:-float32 bfloat16}; do
  echo "round $R main   $(DT=$DT PYTHONPATH=$OLD PAGEDLLM_KERNEL_CACHE=$OLD_KERNELS $PY $R32 deepseek-v2-lite-200m 1 3 2>/dev/null | tr '\n' ' ') $DT load $(cut -d' ' -f1 /proc/loadavg)"
  echo "round $R branch $(DT=$DT PYTHONPATH=$NEW PAGEDLLM_KERNEL_CACHE=$NEW_KERNELS $PY $R32 deepseek-v2-lite-200m 1 3 2>/dev/null | tr '\n' ' ') $DT load $(cut -d' ' -f1 /proc/loadavg)"
done; done
