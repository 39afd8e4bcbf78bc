#!/usr/bin/env bash
# The CUDA checks of pagedllm in one run (for a machine with an NVIDIA GPU; CI has none):
# the Triton paged-attention and CUDA-graph tests natively (slow ones included), then decode
# latency on a random-weight llama-134m in bf16 with CUDA graphs, eager Triton, and eager torch
# SDPA. Usage: bash scripts/gpu_check.sh [OUT_DIR]
set -u
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PAGEDLLM_PRESET_DIR=/tmp/presets
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" -x \
    tests/attention/test_triton_paged.py tests/worker/test_cuda_graph.py \
    tests/worker/test_cudagraph_dispatch.py 2>&1 | tail -15 | tee "$out/tests.txt"
bench() {  # name, env, extra flags
    local name=$1 env=$2; shift 2
    for bs in 1 32; do
        env $env python3 -m pagedllm.entrypoints.cli bench latency --preset llama-134m \
            --dtype bfloat16 --batch-size $bs --input-len 128 --output-len 128 --num-iters 3 \
            --bandwidth-mib 0 "$@" 2>&1 | grep -E "ttft_ms_mean|tpot_ms_mean|share_outside_execute|Error" \
            | sed "s/^/$name bs=$bs: /" | tee -a "$out/bench.txt"
    done
}
bench cudagraphs "PAGEDLLM_ATTENTION_BACKEND=triton_paged"
bench triton_eager "PAGEDLLM_ATTENTION_BACKEND=triton_paged" --enforce-eager
bench sdpa_eager "PAGEDLLM_ATTENTION_BACKEND=torch_sdpa" --enforce-eager
