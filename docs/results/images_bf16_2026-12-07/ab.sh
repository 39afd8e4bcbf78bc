#!/bin/bash
# `pagedllm bench images` (8 prompts x 32 tokens, --compare hf), main and this branch alternated:
# 2 rounds x {qwen2.5-vl-200m, smolvlm-200m} x {bfloat16, float32}, default threads (2).
#   MAIN=<worktree at main's rev> NEW=<this branch's tree> OUT_DIR=<folder> bash ab.sh
set -u
OUT_DIR=${OUT_DIR:-$(dirname "$0")}
for round in 1 2; do
  for preset in qwen2.5-vl-200m smolvlm-200m; do
    for dtype in bfloat16 float32; do
      for tree in main new; do
        root=$MAIN; [ "$tree" = new ] && root=$NEW
        tag=${preset}_${dtype}_${tree}_r${round}
        echo "== $tag load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
        PYTHONPATH=$root nice -n 5 python -m pagedllm.entrypoints.cli bench images \
          --preset "$preset" --dtype "$dtype" --num-prompts 8 --output-len 32 \
          --kv-cache-memory-bytes 268435456 --compare hf --output-json "$OUT_DIR/$tag.json" \
          2>&1 | grep -E "elapsed_s|encoder_s |speedup|ratio|greedy|torch threads" | tr '\n' ' '
        echo
      done
    done
  done
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
