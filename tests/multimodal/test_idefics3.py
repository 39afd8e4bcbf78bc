"""Idefics3 end to end: greedy fp32 tokens equal HF transformers' for prompts with 0, 1 and 2
images, with chunked prefill splitting image placeholder runs, prefix caching and preemption;
each image is encoded once per request (n = 3 and several chunks included); the prefix cache
is keyed by image content."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.fixtures.vlm import draw_image
from tests.multimodal.conftest import MAX_TOKENS, as_engine_prompt, vlm_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm: LLM, params=GREEDY) -> list[list[int]]:
    prompts = [as_engine_prompt(t, ims) for t, ims in vlm_prompts()]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(tiny_idefics3) -> LLM:
    return LLM(str(tiny_idefics3), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=1 << 22)


def test_greedy_equals_hf(llm, hf_idefics3_tokens):
    before = llm.get_stats().num_encoder_runs
    assert _generate(llm) == hf_idefics3_tokens
    # 4 image items, 2 distinct images: each encoded once.
    assert llm.get_stats().num_encoder_runs - before <= 2


def test_chunked_prefill_splits_images_no_prefix_cache(tiny_idefics3, hf_idefics3_tokens):
    # 8 tokens a step: every image's 20 / 12 placeholders span several chunks.
    llm = LLM(str(tiny_idefics3), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=False)
    assert _generate(llm) == hf_idefics3_tokens
    assert llm.get_stats().num_encoder_runs == 2


def test_preemption_and_prefix_caching(tiny_idefics3, hf_idefics3_tokens):
    # 13 usable blocks of 8 tokens for prompts of up to 11 blocks: requests preempt each other
    # and come back, finding their images (and blocks) cached or encoding them again.
    llm = LLM(str(tiny_idefics3), dtype="float32", max_model_len=256, block_size=8,
              num_gpu_blocks_override=14, max_num_batched_tokens=24, max_num_seqs=4,
              enable_prefix_caching=True)
    assert _generate(llm) == hf_idefics3_tokens
    assert llm.get_stats().num_preemptions > 0
    # Twice more: prefix hits on the image blocks must serve the same tokens.
    assert _generate(llm) == hf_idefics3_tokens


def test_n3_encodes_once(llm):
    text, images = vlm_prompts()[0]
    image = draw_image(40, 40, 7)   # not seen by this engine before
    before = llm.get_stats().num_encoder_runs
    [out] = llm.generate([as_engine_prompt(text, [image])],
                         SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4),
                         use_tqdm=False)
    assert len(out.outputs) == 3
    assert llm.get_stats().num_encoder_runs - before == 1


def test_prefix_cache_keyed_by_image(llm):
    text = "Look at this picture: <image> now tell me"
    a, b = draw_image(56, 40, 11), draw_image(56, 40, 12)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first = llm.generate([as_engine_prompt(text, [a])], params, use_tqdm=False)[0]
    same = llm.generate([as_engine_prompt(text, [a])], params, use_tqdm=False)[0]
    other = llm.generate([as_engine_prompt(text, [b])], params, use_tqdm=False)[0]
    feature = llm.llm_engine.input_processor.mm_processor.process(text, [a])[1][0]
    block_size = llm.llm_engine.config.cache_config.block_size
    assert first.num_cached_tokens <= feature.offset
    # The same image and text hit every full block; another image none past the image start.
    assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // block_size * block_size
    assert other.num_cached_tokens <= feature.offset // block_size * block_size


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{"async_scheduling": True},
                                    {"tensor_parallel_size": 2, "max_num_batched_tokens": 16},
                                    {"multiprocess_mode": True},
                                    {"max_num_batched_tokens": 8, "block_size": 8,
                                     "num_gpu_blocks_override": 14, "max_num_seqs": 3}])
def test_engine_variants_equal_hf(tiny_idefics3, hf_idefics3_tokens, kwargs):
    # Async scheduling; tensor parallelism (the vision tower replicated on both ranks); the
    # engine core in its own process (the images cross its socket); chunks of 8 tokens under
    # preemption.
    defaults = {"kv_cache_memory_bytes": 1 << 22} if "num_gpu_blocks_override" not in kwargs \
        else {}
    llm = LLM(str(tiny_idefics3), dtype="float32", max_model_len=256, **defaults, **kwargs)
    assert _generate(llm) == hf_idefics3_tokens
    before = llm.get_stats().num_encoder_runs
    [out] = llm.generate([as_engine_prompt("x <image> y", [draw_image(30, 50, 9)])],
                         SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=3),
                         use_tqdm=False)
    assert len(out.outputs) == 3
    assert llm.get_stats().num_encoder_runs - before == 1
