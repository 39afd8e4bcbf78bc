"""KV cache groups end to end (core/kv_cache_groups.py): on tiny Gemma 3 (full + 8-token window
layers: two groups) and Mistral (every layer an 8-token window: one sliding group) checkpoints, a
prompt of several windows frees its out-of-window blocks while the greedy tokens equal HF's in
fp32, with small chunked-prefill steps, with prefix caching on (the second request is served from
the cache) and off, on both CPU attention backends."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.cpu_paged import CpuPagedBackend

GROUP_WINDOWS = {"gemma3": (None, 8), "mistral_sliding": (8,)}
PROMPT_LEN, MAX_TOKENS = 70, 10
BACKENDS = ["torch_sdpa", "cpu_paged" if CpuPagedBackend.is_available() else "torch_sdpa"]


def _hf_greedy(path: str, prompt: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


CASES = [("gemma3", BACKENDS[1], True),
         pytest.param("gemma3", "torch_sdpa", False, marks=pytest.mark.slow),
         pytest.param("mistral_sliding", BACKENDS[1], False, marks=pytest.mark.slow),
         pytest.param("mistral_sliding", "torch_sdpa", True, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def hf_greedy(tiny_checkpoints):
    """variant -> (prompt, HF's greedy tokens)."""
    cache: dict[str, tuple[list[int], list[int]]] = {}

    def get(variant: str):
        if variant not in cache:
            rng = random.Random(3)
            prompt = [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]
            cache[variant] = prompt, _hf_greedy(str(tiny_checkpoints[variant]), prompt)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant,backend,caching", CASES)
def test_long_prompt_frees_window_blocks_and_matches_hf(tiny_checkpoints, hf_greedy, variant,
                                                        backend, caching, monkeypatch):
    prompt, want = hf_greedy(variant)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
    # One step per round: blocks leave the window at each schedule (a multi-step round frees
    # them at its start, so a round's last few would still be held when the request ends).
    llm = LLM(str(tiny_checkpoints[variant]), dtype="float32", kv_cache_memory_bytes=8 << 20,
              block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
              enable_prefix_caching=caching, num_scheduler_steps=1)
    core = llm.llm_engine.engine_core
    mgr = core.scheduler.kv_cache_manager
    assert tuple(g.sliding_window for g in mgr.kv_cache_groups) == GROUP_WINDOWS[variant]
    assert core.executor.worker.model_runner.kv_cache_windows == GROUP_WINDOWS[variant]
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == want
    # 80 tokens, window 8, blocks of 4: all but the last ~3 sliding blocks were freed.
    assert mgr.num_window_freed_blocks >= (PROMPT_LEN + MAX_TOKENS - 8) // 4 - 2
    again = llm.generate([prompt + want[:3]], params, use_tqdm=False)[0]
    # A hit of 72 tokens needs every full block before 72 and the sliding blocks of 65..71.
    assert again.num_cached_tokens == ((PROMPT_LEN + 2) // 4 * 4 if caching else 0)
    # The continuation of the same greedy sequence: HF's tokens after the first three.
    assert list(again.outputs[0].token_ids)[:MAX_TOKENS - 3] == want[3:]
    mgr.check_invariants()
    assert all(g.block_pool.get_num_free_blocks() == g.block_pool.num_blocks - 1
               for g in mgr.groups)


def test_sliding_window_request_larger_than_the_cache_is_admitted(tiny_checkpoints):
    """Regression (issue #5): Mistral with a window of 8 on every layer, blocks of 4 and a KV cache
    of 72 tokens refused a 75-token prompt with max_tokens 24 at the full-context price (99
    tokens). In 16-token steps it holds at most 7 blocks (window + one step); it is admitted, its
    out-of-window blocks are freed, and its greedy tokens equal HF's (fp32)."""
    path = str(tiny_checkpoints["mistral_sliding"])
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(75)]
    llm = LLM(path, dtype="float32", block_size=4, num_gpu_blocks_override=19,
              max_num_batched_tokens=16)
    core = llm.llm_engine.engine_core
    assert (core.num_blocks - 1) * 4 == 72
    assert core.kv_cache_capacity.max_num_blocks(75, 24) == (7,)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == _hf_greedy(path, prompt, max_new_tokens=24)
    mgr = core.scheduler.kv_cache_manager
    assert mgr.num_window_freed_blocks >= (75 + 24 - 8) // 4 - 7
    assert core.get_stats().num_preemptions == 0
