# A/B of the base (2d54d90: main + the tally, checked out with `git worktree add --detach
# /tmp/gemmplace-base 2d54d90`) and the branch (/work/wt-gemmplace), each with its own kernel
# caches; alternating processes, order swapped per round. First per-call tallies of Qwen3-Next
# (kernels built through cxx-tally.sh at /tmp/gemmplace-cxx-tally), then whole runs (run32.py,
# default builds). Output: ab_all.log (ab_more.sh: DeepSeek tallies and rounds 4-5).
set -u
PY=/work/main/.venv/bin/python
R32=/work/wt-gemmplace/docs/results/b32_dtypes_2026-12-07/run32.py
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
tree() { [ $1 = base ] && echo /tmp/gemmplace-base || echo /work/wt-gemmplace; }
cache() { [ $1 = base ] && echo /tmp/gemmplace-base-kernels$2 || echo /tmp/gemmplace-kernels$2; }
# builds first
for B in base new; do
  PYTHONPATH=$(tree $B) PAGEDLLM_KERNEL_CACHE=$(cache $B "") nice -n 5 $PY -c "from pagedllm.native.kernels.library import build_cpu_kernels; build_cpu_kernels()" 2>/dev/null
  CXX=/tmp/gemmplace-cxx-tally PYTHONPATH=$(tree $B) PAGEDLLM_KERNEL_CACHE=$(cache $B -tally) nice -n 5 $PY -c "from pagedllm.native.kernels.library import build_cpu_kernels; build_cpu_kernels()" 2>/dev/null
done
echo "builds done $(date +%T)"
# tally A/B: Qwen3-Next, 128 tokens, 2 rounds, order swapped per round
for DT in float32 bfloat16; do for R in 1 2; do
  for B in $([ $R = 1 ] && echo "base new" || echo "new base"); do
    echo "tally $DT round $R $B $(CXX=/tmp/gemmplace-cxx-tally DT=$DT PYTHONPATH=$(tree $B) PAGEDLLM_KERNEL_CACHE=$(cache $B -tally) $PY $R32 qwen3-next-200m 128 1 2>/tmp/gemmplace/tab-$DT-$R-$B.txt | tail -1) load $(cut -d' ' -f1 /proc/loadavg)"
  done
done; done
echo "tally done $(date +%T)"
for R in 1 2 3; do for DT in float32 bfloat16; do for P in qwen3-next-200m deepseek-v2-lite-200m; do
  for B in $([ $((R % 2)) = 1 ] && echo "base new" || echo "new base"); do
    echo "whole round $R $B $(DT=$DT PYTHONPATH=$(tree $B) PAGEDLLM_KERNEL_CACHE=$(cache $B "") $PY $R32 $P 128 1 2>/dev/null | tail -1) $DT load $(cut -d' ' -f1 /proc/loadavg)"
  done
done; done; done
echo "all done $(date +%T)"
