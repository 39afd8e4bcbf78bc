# Whole-run A/B of transparent huge pages (needs root): the system-wide THP mode switched
# between madvise (this host's default) and always before each run32.py process; restored after.
R32=/work/main/docs/results/b32_dtypes_2026-12-07/run32.py
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
cd /tmp
for R in 1 2; do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
for M in madvise always; do
  echo $M > /sys/kernel/mm/transparent_hugepage/enabled
  echo "round $R thp=$M $(DT=float32 /work/main/.venv/bin/python $R32 $P 128 1 2>/dev/null | tail -1) load $(cut -d' ' -f1 /proc/loadavg) anonhuge_after $(grep AnonHuge /proc/meminfo | awk '{print $2}')"
done; done; done
echo madvise > /sys/kernel/mm/transparent_hugepage/enabled
