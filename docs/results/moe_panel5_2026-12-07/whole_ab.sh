# Engine A/B: OLD's tree and this checkout alternated in separate processes (kernels built into
# their own caches), run32.py: 32 x (128 -> OUT) greedy, OUT = 1 (the prefill alone) and 128
# (whole runs), one thread, wall and thread CPU per LLM.generate; the order of the two trees
# alternates between rounds. Output: whole_ab.txt.
#   OLD=/work/main bash whole_ab.sh
HERE=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$HERE/../../.." && pwd)
OLD=${OLD:-/work/main}
R32=$HERE/../b32_dtypes_2026-12-07/run32.py
PY=${PY:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
run() {  # tree label dtype preset out
  local cache=$([ $2 = old ] && echo /tmp/moepanel-oldkernels || echo /tmp/moepanel-newkernels)
  echo "round $R $2 $3 $(DT=$3 PYTHONPATH=$1 PAGEDLLM_KERNEL_CACHE=$cache $PY $R32 $4 $5 1 2>/dev/null | tail -1) load $(cut -d' ' -f1 /proc/loadavg)"
}
for R in ${ROUNDS:-1 2 3}; do
for OUT in ${OUTS:-1 128}; do
for DT in float32 bfloat16; do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
  if [ $((R % 2)) = 1 ]; then run $OLD old $DT $P $OUT; run $NEW new $DT $P $OUT
  else run $NEW new $DT $P $OUT; run $OLD old $DT $P $OUT; fi
done; done; done; done
