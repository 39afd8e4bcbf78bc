"""Qwen3-VL end to end: greedy fp32 tokens equal HF transformers' `generate` for prompts with
0, 1 and 2 images of different sizes (DeepStack features added after the first decoder layers,
interleaved M-RoPE, interpolated learned vision positions), with chunked prefill splitting the
images, prefix caching and preemption, and without any of them; each image is encoded once."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import LLM
from tests.fixtures.qwen_vl import build_tiny_qwen3_vl
from tests.multimodal.test_qwen2_5_vl import MAX_TOKENS, _generate, _hf_inputs, qwen_prompts


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"))


@pytest.fixture(scope="module")
def hf_tokens(tiny_qwen3_vl) -> list[list[int]]:
    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(
        tiny_qwen3_vl, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_vl)
    out = []
    for text, images in qwen_prompts():
        inputs = _hf_inputs(tokenizer, text, images)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def test_greedy_equals_hf(tiny_qwen3_vl, hf_tokens):
    llm = LLM(str(tiny_qwen3_vl), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    assert _generate(llm) == hf_tokens
    # 4 image items, 2 distinct images: each encoded once.
    assert llm.get_stats().num_encoder_runs == 2


def test_greedy_equals_hf_chunked_preempted_prefix_cached(tiny_qwen3_vl, hf_tokens):
    # 8 tokens a step split the 15- and 12-token images; 10 blocks of 8 tokens for prompts of
    # up to 6 blocks make requests preempt each other; the second round hits the prefix cache.
    llm = LLM(str(tiny_qwen3_vl), dtype="float32", max_model_len=256, block_size=8,
              num_gpu_blocks_override=10, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=True)
    assert _generate(llm) == hf_tokens
    assert llm.get_stats().num_preemptions > 0
    assert _generate(llm) == hf_tokens
