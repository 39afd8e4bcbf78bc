# Batch 1 against llama.cpp, the native stack + decode loop on (run from this folder with
# PYTHONPATH at the checkout): rounds alternate the presets.
export PAGEDLLM_LLAMACPP_SITE_PACKAGES=/work/lcpp-venv/lib/python3.11/site-packages
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
CONV=/work/lcpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
for R in ${ROUNDS:-1 2}; do
for P in deepseek-v2-lite-200m qwen3-next-200m; do
  uptime
  /work/main/.venv/bin/pagedllm bench throughput --preset $P --dtype float32 --num-prompts 1 --input-len 128 \
    --output-len 128 --compare llamacpp --llamacpp-threads 1 --llamacpp-converter $CONV \
    --output-json ${P}_1x128_fp32_1thread_r$R.json
  uptime
done
done
