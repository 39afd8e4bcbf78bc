#!/bin/bash
# main vs this branch: thread CPU time of LLM.generate, 32 x (128 -> 128), one thread, alternated.
D=$(cd "$(dirname "$0")" && pwd); NEW=${NEW:-$(cd "$D/../../.." && pwd)}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
for r in 1 2; do
  for side in main new; do
    if [ $side = main ]; then
      out=$(cd /work/main && env -u PAGEDLLM_KERNEL_CACHE PYTHONPATH=/work/main /work/main/.venv/bin/python $D/run32.py 128 2>&1 | grep "generate thread")
    else
      out=$(cd $NEW && PAGEDLLM_KERNEL_CACHE=/tmp/ds-b32-kcache PYTHONPATH=$NEW /work/main/.venv/bin/python $D/run32.py 128 2>&1 | grep "generate thread")
    fi
    echo "round $r $side: $out"
  done
done
