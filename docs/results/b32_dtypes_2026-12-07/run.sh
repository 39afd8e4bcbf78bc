# End-of-sitting batch-32 figures (issues #36, #37) on one idle 2-core host, run from the
# repository root: 32 x (128 -> 128), one thread, each row one `pagedllm bench throughput` run
# with HF transformers' `generate` in the same run and the same dtype (float32 also against
# llama.cpp on the F32 GGUF of the same weights). DTYPES / PRESETS narrow it down; OUT_DIR
# (default: this folder) takes the JSON files.
export PAGEDLLM_LLAMACPP_SITE_PACKAGES=/work/lcpp-venv/lib/python3.11/site-packages
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
CONV=/work/lcpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
D=${OUT_DIR:-$(dirname "$0")}
bench() { python -c "import sys; from pagedllm.entrypoints.cli import main; sys.argv[0] = 'pagedllm'; sys.exit(main())" bench throughput "$@"; }
for DT in ${DTYPES:-float32 bfloat16}; do
for P in ${PRESETS:-deepseek-v2-lite-200m qwen3-next-200m}; do
  echo "== batch 32 $P $DT: $(uptime)"
  PEERS="--compare hf"
  [ "$DT" = float32 ] && PEERS="$PEERS --compare llamacpp --llamacpp-threads 1 --llamacpp-converter $CONV"
  bench --preset $P --dtype $DT --num-prompts 32 --input-len 128 --output-len 128 $PEERS \
    --output-json $D/${P}_32x128_${DT}${TAG}.json
done
done
echo "== end: $(uptime)"
