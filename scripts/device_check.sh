#!/usr/bin/env bash
# The CUDA checks of pagedllm in one run, about 5 minutes on one H200 (CI has no GPU). Needs a
# python with torch, triton and transformers; no network (models are random-weight presets built
# locally under $PAGEDLLM_PRESET_DIR).
#   1. the Triton paged-attention and CUDA-graph tests natively, slow ones included, while the
#      llama-1b preset (1.1B parameters, bf16) is built on the CPU in the background;
#   2. llama-1b decode latency in bf16, CUDA graphs on and off (batch 1 and 32), and a roofline
#      line for batch-1 decode: weight bytes read per step / TPOT against 4.8 TB/s of HBM;
#   3. llama-1b offline throughput at batch 64 against HF transformers (`--compare hf`);
#   4. llama-134m decode latency in bf16 with CUDA graphs, eager Triton and eager torch SDPA.
# Usage: bash scripts/device_check.sh [OUT_DIR]   (PYTHON=... picks the interpreter)
set -u
out=${1:-${OUT:-/tmp/device_check}}
mkdir -p "$out/logs"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PAGEDLLM_PRESET_DIR=${PAGEDLLM_PRESET_DIR:-/tmp/presets}
HBM_TBPS=4.8   # H200 HBM3e peak
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$out/timeline.txt"; }

stamp "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"

# The 1B checkpoint takes a while to initialise and save on the CPU: overlap it with the tests.
$py -c "from pagedllm.benchmarks.presets import preset_path
print(preset_path('llama-1b', 'bfloat16'))" >"$out/logs/preset_build.txt" 2>&1 &
build_pid=$!

stamp "tests"
timeout 300 $py -m pytest -q -p no:cacheprovider -m "slow or not slow" -x \
    tests/attention/test_triton_paged.py tests/worker/test_cuda_graph.py \
    tests/worker/test_cudagraph_dispatch.py 2>&1 | tail -15 | tee "$out/tests.txt"

stamp "waiting for the llama-1b preset"
wait $build_pid || { echo "llama-1b preset build failed:"; tail -20 "$out/logs/preset_build.txt"; }
stamp "llama-1b preset: $(tail -1 "$out/logs/preset_build.txt")"

latency() {  # label, preset, batch size, env assignments (space-separated), extra flags...
    local label=$1 preset=$2 bs=$3 env=$4; shift 4
    local log="$out/logs/latency_${label}_bs${bs}.txt"
    env $env timeout 150 $py -m pagedllm.entrypoints.cli bench latency --preset "$preset" \
        --dtype bfloat16 --batch-size "$bs" --input-len 128 --output-len 128 --num-iters 3 \
        --bandwidth-mib 0 --output-json "$out/latency_${label}_bs${bs}.json" "$@" >"$log" 2>&1
    grep -E "ttft_ms_mean|tpot_ms_mean|share_outside_execute|Error" "$log" \
        | sed "s/^/$label bs=$bs: /" | tee -a "$out/bench.txt"
}

stamp "llama-1b latency"
for bs in 1 32; do
    latency llama1b_graphs llama-1b $bs "PAGEDLLM_ATTENTION_BACKEND=triton_paged"
    latency llama1b_eager llama-1b $bs "PAGEDLLM_ATTENTION_BACKEND=triton_paged" --enforce-eager
done

# Batch-1 decode reads every weight but the embedding table once per token (plus a little KV
# cache): weight bytes / TPOT is the bandwidth achieved, HBM peak / that the gap to the bound.
$py - "$out" "$HBM_TBPS" <<'EOF' 2>&1 | tee -a "$out/roofline.txt"
import json, sys
from pathlib import Path

import torch

from pagedllm.benchmarks.latency import decode_bytes_per_token

out, peak_tbps = Path(sys.argv[1]), float(sys.argv[2])
for label in ("llama1b_graphs", "llama1b_eager"):
    path = out / f"latency_{label}_bs1.json"
    if not path.is_file():
        print(f"roofline {label} bs=1: no result ({path.name} missing; see logs/)")
        continue
    result = json.loads(path.read_text())["results"][0]
    weight_bytes = decode_bytes_per_token(result["model"], torch.bfloat16)["weight_bytes_per_step"]
    tpot_s = result["tpot_ms_mean"] / 1e3
    achieved_tbps = weight_bytes / tpot_s / 1e12
    bound_ms = weight_bytes / (peak_tbps * 1e12) * 1e3
    print(f"roofline {label} bs=1: {weight_bytes / 1e9:.3f} GB of weights / TPOT "
          f"{tpot_s * 1e3:.3f} ms = {achieved_tbps:.2f} TB/s = {achieved_tbps / peak_tbps:.0%} of "
          f"{peak_tbps} TB/s HBM (bound {bound_ms:.3f} ms/token)")
EOF

stamp "llama-1b throughput vs HF, batch 64"
log="$out/logs/throughput_llama1b.txt"
timeout 240 $py -m pagedllm.entrypoints.cli bench throughput --preset llama-1b --dtype bfloat16 \
    --num-prompts 64 --input-len 128 --output-len 128 --max-num-seqs 64 --hf-batch-size 64 \
    --gpu-memory-utilization 0.5 --compare hf --output-json "$out/throughput_llama1b.json" \
    >"$log" 2>&1
grep -E "throughput|/ hf|tokens_per_s|elapsed|greedy|Error" "$log" | tee -a "$out/bench.txt"

stamp "llama-134m latency"
for bs in 1 32; do
    latency cudagraphs llama-134m $bs "PAGEDLLM_ATTENTION_BACKEND=triton_paged"
    latency triton_eager llama-134m $bs "PAGEDLLM_ATTENTION_BACKEND=triton_paged" --enforce-eager
    latency sdpa_eager llama-134m $bs "PAGEDLLM_ATTENTION_BACKEND=torch_sdpa" --enforce-eager
done
stamp "done"
