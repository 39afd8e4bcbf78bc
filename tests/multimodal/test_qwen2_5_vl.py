"""Qwen2.5-VL end to end: greedy fp32 tokens equal HF transformers' `generate` for prompts
with 0, 1 and 2 images of different sizes (M-RoPE positions, window attention in the ViT), with
chunked prefill splitting image placeholder runs, prefix caching and preemption on and off;
each image is encoded once; the prompt's M-RoPE positions equal HF's `get_rope_index`;
`LLM.chat` with an image part equals HF's chat template + `generate`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from tests.fixtures.qwen_vl import build_tiny_qwen2_5_vl, qwen_vl_image_processor
from tests.fixtures.vlm import draw_image

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def qwen_prompts() -> list[tuple[str, list]]:
    """0, 1 and 2 images: 40x24 px (15 tokens, ragged 2x2 windows), 16x48 px (12 tokens)."""
    wide, tall = draw_image(40, 24, 1), draw_image(16, 48, 2)
    return [(f"The cat {IMAGE} sees", [wide]),
            (f"A {IMAGE} and {IMAGE} too", [wide, tall]),
            ("Just some text here", []),
            (f"{IMAGE} a tall one", [tall])]


def _engine_prompt(text: str, images: list):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _hf_inputs(tokenizer, text: str, images: list) -> dict:
    """HF's model inputs built here from the image processor: each <|image_pad|> expanded to
    t*h*w/4 tokens (Qwen2_5_VLProcessor.replace_image_token), mm_token_type_ids 1 on them."""
    import torch

    inputs = {}
    if images:
        out = qwen_vl_image_processor()(images=images, return_tensors="pt")
        parts = text.split("<|image_pad|>")
        counts = [int(g.prod()) // 4 for g in out["image_grid_thw"]]
        text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    ids = torch.tensor([tokenizer(text).input_ids])
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == image_id).int(), **inputs}


@pytest.fixture(scope="module")
def tiny_qwen_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))


@pytest.fixture(scope="module")
def hf_model(tiny_qwen_vl):
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_qwen_vl, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_qwen_vl)


@pytest.fixture(scope="module")
def hf_tokens(hf_model) -> list[list[int]]:
    import torch

    model, tokenizer = hf_model
    out = []
    for text, images in qwen_prompts():
        inputs = _hf_inputs(tokenizer, text, images)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def _generate(llm: LLM) -> list[list[int]]:
    prompts = [_engine_prompt(t, ims) for t, ims in qwen_prompts()]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_mrope_positions_equal_hf_rope_index(tiny_qwen_vl, hf_model):
    from pagedllm.config import MultiModalConfig
    from pagedllm.multimodal.processing import MultiModalProcessor
    from pagedllm.multimodal.qwen_vl import mrope_input_positions

    model, tokenizer = hf_model
    processor = MultiModalProcessor.from_pretrained(
        str(tiny_qwen_vl), model.config.to_dict(), MultiModalConfig())
    text, images = qwen_prompts()[1]
    token_ids, features = processor.process(text, images)
    inputs = _hf_inputs(tokenizer, text, images)
    assert token_ids == inputs["input_ids"][0].tolist()
    ours, delta = mrope_input_positions(len(token_ids), features, 2)
    ref, ref_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta) != 0
    assert [f.data["image_grid_thw"].tolist() for f in features] == [[1, 6, 10], [1, 12, 4]]


@pytest.fixture(scope="module")
def llm(tiny_qwen_vl) -> LLM:
    return LLM(str(tiny_qwen_vl), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=1 << 22)


def test_greedy_equals_hf(llm, hf_tokens):
    before = llm.get_stats().num_encoder_runs
    assert _generate(llm) == hf_tokens
    # 4 image items, 2 distinct images: each encoded once.
    assert llm.get_stats().num_encoder_runs - before == 2


def test_chat_equals_hf_template(llm, hf_model):
    import torch

    model, tokenizer = hf_model
    image = draw_image(32, 32, 5)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image"},
                                             {"type": "text", "text": " what is it?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = _hf_inputs(tokenizer, text, [image])
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    messages[0]["content"][1] = {"type": "image_pil", "image_pil": image}
    [out] = llm.chat(messages, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ids[0, inputs["input_ids"].shape[1]:].tolist()


def test_chunked_prefill_splits_images_no_prefix_cache(tiny_qwen_vl, hf_tokens):
    # 8 tokens a step: the 15- and 12-token images span several chunks; one token a round.
    llm = LLM(str(tiny_qwen_vl), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=False, num_scheduler_steps=1)
    assert _generate(llm) == hf_tokens
    assert llm.get_stats().num_encoder_runs == 2


def test_preemption_and_prefix_caching(tiny_qwen_vl, hf_tokens):
    # 9 usable blocks of 8 tokens for prompts of up to 6 blocks: requests preempt each other
    # and come back (their M-RoPE positions recomputed), then hit the prefix cache.
    llm = LLM(str(tiny_qwen_vl), dtype="float32", max_model_len=256, block_size=8,
              num_gpu_blocks_override=10, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True)
    assert _generate(llm) == hf_tokens
    assert llm.get_stats().num_preemptions > 0
    assert _generate(llm) == hf_tokens


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{"async_scheduling": True},
                                    {"tensor_parallel_size": 2, "max_num_batched_tokens": 16},
                                    {"multiprocess_mode": True}])
def test_engine_variants_equal_hf(tiny_qwen_vl, hf_tokens, kwargs):
    # Async scheduling (positions from the step's token indices, not its sampled ids); tensor
    # parallelism (the ViT's heads and MLP split over both ranks); the engine core in its own
    # process (the image grids cross its socket).
    llm = LLM(str(tiny_qwen_vl), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 22, **kwargs)
    assert _generate(llm) == hf_tokens
