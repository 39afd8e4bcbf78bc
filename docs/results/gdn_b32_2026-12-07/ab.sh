# Whole-run A/B: main (b898fcf, $OLD, kernels in their own cache) and this branch alternated in
# separate processes; wall and thread CPU per LLM.generate of 32 x (128 -> 128) greedy
# (../b32_dtypes_2026-12-07/run32.py), qwen3-next-200m, one thread. Output: ab.txt.
OLD=${OLD:-/work/main}
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
R32=$NEW/docs/results/b32_dtypes_2026-12-07/run32.py
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
for R in 1 2; do
for DT in float32 bfloat16; do
  echo "round $R main   $(DT=$DT PYTHONPATH=$OLD PAGEDLLM_KERNEL_CACHE=/tmp/gdn-mainkernels $PY $R32 qwen3-next-200m 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "round $R branch $(DT=$DT PYTHONPATH=$NEW PAGEDLLM_KERNEL_CACHE=/tmp/gdn-kernels $PY $R32 qwen3-next-200m 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1-3 /proc/loadavg)"
done; done
