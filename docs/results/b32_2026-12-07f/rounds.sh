#!/bin/bash
# Rounds of the 200M presets' batch-32 bench against HF (issues #36 / #37), run from the
# repository root. DTYPE unset: the bench's default ("auto": bfloat16 where the CPU has native
# bf16, else float32); THREADS (default 1) for both sides; OUT (default this folder); ROUNDS.
export OMP_NUM_THREADS=${THREADS:-1} PAGEDLLM_CPU_THREADS=${THREADS:-1}
D=${OUT:-$(dirname "$0")}
for i in $(seq ${ROUNDS:-3}); do for P in deepseek-v2-lite-200m qwen3-next-200m; do
  echo "== $i $P ${DTYPE:-default dtype} $(uptime)"
  pagedllm bench throughput --preset $P ${DTYPE:+--dtype $DTYPE} --num-prompts 32 \
    --input-len 128 --output-len 128 --compare hf --output-json $D/${P}_${DTYPE:-auto}_$i.json \
    2>&1 | grep -E "output_tokens_per_s_ratio|greedy_identical"
done; done
echo "== end $(uptime)"
