#!/bin/bash
# `pagedllm bench throughput` (pagedllm alone) for qwen3-next-200m bf16, 32 x (128 -> 128), one
# thread: main ($OLD) and this checkout alternated, ROUNDS rounds, order swapped every round.
OLD=${OLD:-/tmp/q3nbf16-main}
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
one() {  # one NAME TREE CACHE
  echo "$1 $(PYTHONPATH=$2 PAGEDLLM_KERNEL_CACHE=$3 $PY -c "import sys; from pagedllm.entrypoints.cli import main; sys.argv[0] = 'pagedllm'; sys.exit(main())" bench throughput --preset qwen3-next-200m --dtype ${DT:-bfloat16} --num-prompts 32 --input-len 128 --output-len 128 2>/dev/null | grep -E '^output_tokens_per_s' | tr -s ' ') load $(cut -d' ' -f1 /proc/loadavg)"
}
for R in $(seq 1 ${ROUNDS:-2}); do
  if [ $((R % 2)) = 1 ]; then
    one "round $R main" $OLD ${OLD_CACHE:-$OLD-kernels}; one "round $R branch" $NEW ${NEW_CACHE:-$NEW-kernels}
  else
    one "round $R branch" $NEW ${NEW_CACHE:-$NEW-kernels}; one "round $R main" $OLD ${OLD_CACHE:-$OLD-kernels}
  fi
done
