# The prefill alone, OLD's tree and this checkout alternated in separate processes (their own
# kernel caches), prefill_runs.py (RUNS samples per process), one thread. Output: prefill_ab.txt.
HERE=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$HERE/../../.." && pwd)
OLD=${OLD:-/work/main}
PY=${PY:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
run() {  # tree label dtype preset
  local cache=$([ $2 = old ] && echo /tmp/moepanel-oldkernels || echo /tmp/moepanel-newkernels)
  echo "round $R $2 $(DT=$3 PYTHONPATH=$1 PAGEDLLM_KERNEL_CACHE=$cache $PY $HERE/prefill_runs.py $4 ${RUNS:-5} 2>/dev/null | tail -1) load $(cut -d' ' -f1 /proc/loadavg)"
}
for R in ${ROUNDS:-1 2 3}; do
for DT in float32 bfloat16; do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
  if [ $((R % 2)) = 1 ]; then run $OLD old $DT $P; run $NEW new $DT $P
  else run $NEW new $DT $P; run $OLD old $DT $P; fi
done; done; done
