# Batch 32 of the 200M presets against HF generate and llama.cpp, one thread each
# (run from the repository root; writes the JSON files next to this script).
export PAGEDLLM_LLAMACPP_SITE_PACKAGES=/work/lcpp-venv/lib/python3.11/site-packages
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
CONV=/work/lcpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
D=$(dirname "$0")
for P in deepseek-v2-lite-200m qwen3-next-200m; do
  uptime
  python -c "import sys; from pagedllm.entrypoints.cli import main; sys.argv[0] = 'pagedllm'; sys.exit(main())" bench throughput --preset $P --dtype float32 --num-prompts 32 \
    --input-len 128 --output-len 128 --compare hf --compare llamacpp --llamacpp-threads 1 \
    --llamacpp-converter $CONV --output-json $D/${P}_32x128_fp32_1thread${ROUND:+_$ROUND}.json
  uptime
done
