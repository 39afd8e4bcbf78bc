# Whole-run A/B: the sitting's start (db53dd9, checked out at $OLD with its kernels built into
# their own cache) and this checkout alternated in separate processes; wall and thread CPU per
# LLM.generate of 32 x (128 -> 128) greedy (run32.py), one thread. Output: ab.txt.
OLD=${OLD:-/tmp/old}   # git worktree add --detach $OLD db53dd9
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
R32=$(cd "$(dirname "$0")" && pwd)/run32.py
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
for R in 1 2; do
for DT in float32 bfloat16; do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
  echo "round $R old $(DT=$DT PYTHONPATH=$OLD PAGEDLLM_KERNEL_CACHE=$OLD-kernels python $R32 $P 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1 /proc/loadavg)"
  echo "round $R new $(DT=$DT PYTHONPATH=$NEW python $R32 $P 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1 /proc/loadavg)"
done; done; done
