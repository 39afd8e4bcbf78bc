# Batch 1 against llama.cpp, one thread: bash b.sh CHECKOUT OUT.json (OUTLEN=1: prefill alone).
# Rounds alternated main (base*) and this branch (new*); pf*: this branch, 1 output token.
export PAGEDLLM_LLAMACPP_SITE_PACKAGES=/work/lcpp-venv/lib/python3.11/site-packages
export OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1
export PYTHONPATH=$1
CONV=/work/lcpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
uptime
/work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench throughput --preset deepseek-v2-lite-200m --dtype float32 --num-prompts 1 --input-len 128 \
    --output-len ${OUTLEN:-128} --compare llamacpp --llamacpp-threads 1 --llamacpp-converter $CONV --output-json $2
uptime
