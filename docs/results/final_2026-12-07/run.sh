# End-of-session figures on one idle 2-core AVX-512 host, after all merges (run from the
# repository root): batch 1 (two rounds, presets alternated) and batch 32 (one round), each
# one `bench throughput` run (ROUNDS="3 4 5" SKIP_B32=1 for more batch-1 rounds) against llama.cpp (and HF at batch 32) in the same process run.
export PAGEDLLM_LLAMACPP_SITE_PACKAGES=/work/lcpp-venv/lib/python3.11/site-packages
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
CONV=/work/lcpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
D=$(dirname "$0")
bench() { python -c "import sys; from pagedllm.entrypoints.cli import main; sys.argv[0] = 'pagedllm'; sys.exit(main())" bench throughput "$@"; }
for R in ${ROUNDS:-1 2}; do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
  echo "== batch 1 $P round $R: $(uptime)"
  bench --preset $P --dtype float32 --num-prompts 1 --input-len 128 --output-len 128 \
    --compare llamacpp --llamacpp-threads 1 --llamacpp-converter $CONV \
    --output-json $D/${P}_1x128_r$R.json
done
done
[ -n "$SKIP_B32" ] || for P in deepseek-v2-lite-200m qwen3-next-200m; do
  echo "== batch 32 $P: $(uptime)"
  bench --preset $P --dtype float32 --num-prompts 32 --input-len 128 --output-len 128 \
    --compare hf --compare llamacpp --llamacpp-threads 1 --llamacpp-converter $CONV \
    --output-json $D/${P}_32x128.json
done
echo "== end: $(uptime)"
