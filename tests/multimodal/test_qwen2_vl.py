"""Qwen2-VL end to end: greedy fp32 tokens equal HF transformers' `generate` for prompts with
0, 1 and 2 images of different sizes (its tower: LayerNorm, quick-GELU MLP, no windows; the
Qwen2 decoder with M-RoPE), with chunked prefill of 8 tokens splitting the images' placeholder
runs; each image is encoded once; the tower's image embeddings equal HF's."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.fixtures.qwen_vl import build_tiny_qwen2_vl, qwen_vl_image_processor
from tests.multimodal.test_qwen2_5_vl import MAX_TOKENS, _generate, _hf_inputs, qwen_prompts


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2_vl):
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2_vl,
                                                           dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokens(tiny_qwen2_vl, hf_model) -> list[list[int]]:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    out = []
    for text, images in qwen_prompts():
        inputs = _hf_inputs(tokenizer, text, images)
        with torch.no_grad():
            ids = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def test_greedy_equals_hf_chunked_prefill(tiny_qwen2_vl, hf_model, hf_tokens):
    import torch
    from transformers import AutoConfig

    from pagedllm.model_loader.loader import load_model

    # 8 tokens a step: the 15- and 12-token images span several chunks.
    llm = LLM(str(tiny_qwen2_vl), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=False)
    assert _generate(llm) == hf_tokens
    # 4 image items, 2 distinct images: each encoded once.
    assert llm.get_stats().num_encoder_runs == 2

    # The tower alone (greedy tokens can hide small errors, e.g. GELU for quick-GELU).
    ours = load_model(str(tiny_qwen2_vl), AutoConfig.from_pretrained(tiny_qwen2_vl),
                      torch.float32, torch.device("cpu"))
    images = qwen_prompts()[1][1]
    out = qwen_vl_image_processor()(images=images, return_tensors="pt")
    sizes = out["image_grid_thw"].prod(-1).tolist()
    items = [{"pixel_values": p.numpy(), "image_grid_thw": g.numpy()}
             for p, g in zip(out["pixel_values"].split(sizes), out["image_grid_thw"])]
    with torch.no_grad():
        ref = hf_model.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
        for a, b in zip(ours.embed_multimodal(items), ref.pooler_output, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_preemption_prefix_caching_equal_hf(tiny_qwen2_vl, hf_tokens):
    # TP 2 splits the tower's fused qkv shard by shard; 10 blocks of 8 tokens make requests
    # preempt each other; the second round hits the prefix cache.
    llm = LLM(str(tiny_qwen2_vl), dtype="float32", max_model_len=256, tensor_parallel_size=2,
              block_size=8, num_gpu_blocks_override=10, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    assert _generate(llm) == hf_tokens
    assert llm.get_stats().num_preemptions > 0
    assert _generate(llm) == hf_tokens
