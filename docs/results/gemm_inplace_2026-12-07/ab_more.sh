# Continuation of ab_all.sh (same trees and caches): DeepSeek float32 tallies, whole rounds 4 and 5.
set -u
PY=/work/main/.venv/bin/python
R32=/work/wt-gemmplace/docs/results/b32_dtypes_2026-12-07/run32.py
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
tree() { [ $1 = base ] && echo /tmp/gemmplace-base || echo /work/wt-gemmplace; }
cache() { [ $1 = base ] && echo /tmp/gemmplace-base-kernels$2 || echo /tmp/gemmplace-kernels$2; }
for B in base new; do
  echo "tally deepseek float32 $B $(CXX=/tmp/gemmplace-cxx-tally DT=float32 PYTHONPATH=$(tree $B) PAGEDLLM_KERNEL_CACHE=$(cache $B -tally) $PY $R32 deepseek-v2-lite-200m 128 1 2>/tmp/gemmplace/tab-ds-float32-$B.txt | tail -1) load $(cut -d' ' -f1 /proc/loadavg)"
done
for R in 4 5; do for DT in float32 bfloat16; do for P in qwen3-next-200m deepseek-v2-lite-200m; do
  for B in $([ $((R % 2)) = 1 ] && echo "base new" || echo "new base"); do
    echo "whole round $R $B $(DT=$DT PYTHONPATH=$(tree $B) PAGEDLLM_KERNEL_CACHE=$(cache $B "") $PY $R32 $P 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1 /proc/loadavg)"
  done
done; done; done
echo "all done $(date +%T)"
