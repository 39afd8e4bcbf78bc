# A third (and fourth: tags _r4) round, bf16 only (as ab.sh): MAIN=<tree> NEW=<tree> OUT_DIR=<folder> bash ab_r3.sh
set -u
for preset in qwen2.5-vl-200m smolvlm-200m; do
  for tree in main new; do
    root=$MAIN; [ "$tree" = new ] && root=$NEW
    tag=${preset}_bfloat16_${tree}_r3
    echo "== $tag load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    PYTHONPATH=$root nice -n 5 python -m pagedllm.entrypoints.cli bench images \
      --preset "$preset" --dtype bfloat16 --num-prompts 8 --output-len 32 \
      --kv-cache-memory-bytes 268435456 --compare hf --output-json "$OUT_DIR/$tag.json" \
      2>&1 | grep -E "elapsed_s|encoder_s |requests_per_s_ratio|greedy_identical" | tr '\n' ' '
    echo
  done
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
