"""Prefix caching, eviction and preemption end to end on tiny fp32 checkpoints.

Oracle (DESIGN.md §6): the engine against itself. Greedy and seeded tokens with prefix caching on,
a KV cache small enough to evict and preempt, and chunked prefill must equal those of a run with a
large cache and prefix caching off. Prompts are token-id lists so shared prefixes are exact.
"""

from __future__ import annotations

import json
import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_utils import kv_cache_bytes_per_block

VOCAB_LOW, VOCAB_HIGH = 3, 500  # clear of the special tokens at the bottom of the tiny vocabularies


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference_llm(tiny_llama):
    """A large cache with prefix caching off: the oracle."""
    return LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=False,
               num_gpu_blocks_override=256, max_num_batched_tokens=1024, max_num_seqs=32)


@pytest.mark.parametrize("together", [False, True], ids=["sequential", "same_step"])
def test_shared_prefix_computes_only_the_suffix(tiny_llama, reference_llm, together):
    rng = random.Random(1)
    prefix = random_tokens(rng, 70)  # 4 full blocks of 16 = 64 cacheable tokens
    prompts = [prefix + random_tokens(rng, 5), prefix + random_tokens(rng, 9)]
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=True,
              num_gpu_blocks_override=64, max_num_batched_tokens=512)
    if together:
        # Both in one step: the second hits blocks the first fills in that very forward pass.
        outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    else:
        outputs = [llm.generate(p, greedy(6), use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [0, 64]
    stats = llm.get_stats().prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 75 + 79, 64)
    assert token_ids(outputs) == token_ids(reference_llm.generate(prompts, greedy(6),
                                                                   use_tqdm=False))


def test_eviction_and_preemption_keep_tokens(tiny_llama, reference_llm):
    rng = random.Random(2)
    prefixes = [random_tokens(rng, n) for n in (12, 24, 40)]
    prompts = []
    for i in range(24):
        shared = prefixes[i % 3] if i % 4 else []
        prompts.append(shared + random_tokens(rng, rng.randint(3, 12)))
    # Greedy, and seeded sampling (its noise depends on the output position only, so a
    # recomputed request draws the same tokens).
    params = [greedy(rng.randint(3, 8)) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(3, 8),
                             ignore_eos=True) for i in range(len(prompts))]
    # 13 usable blocks of 8 tokens: far less than the batch needs, so blocks are evicted and
    # running requests are preempted; a small token budget chunks the longer prompts.
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=True, block_size=8,
              num_gpu_blocks_override=14, max_num_batched_tokens=40, max_num_seqs=8)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = reference_llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_stats.hits > 0
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert stats.num_free_blocks == stats.num_blocks - 1
    scheduler = llm.llm_engine.engine_core.scheduler
    scheduler.kv_cache_manager.block_pool.check_invariants()
    assert not scheduler.kv_cache_manager.req_to_blocks


def test_stats_and_reset_prefix_cache(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=True,
              num_gpu_blocks_override=32)
    prompt = random_tokens(random.Random(3), 40)  # 2 full blocks of 16
    stats = llm.get_stats()
    assert (stats.num_blocks, stats.num_free_blocks, stats.num_cached_blocks) == (32, 31, 0)
    assert stats.num_preemptions == 0 and stats.prefix_cache_stats.hit_rate == 0.0

    # Blocks in use are visible while a request runs.
    engine = llm.llm_engine
    engine.add_request("probe", prompt, greedy(4))
    engine.step()
    stats = llm.get_stats()
    used = stats.num_blocks - 1 - stats.num_free_blocks
    assert used == 3 and stats.kv_cache_usage == pytest.approx(3 / 31)
    assert stats.num_running_reqs == 1 and stats.num_cached_blocks == 2
    while engine.has_unfinished_requests():
        engine.step()

    first = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 32
    stats = llm.get_stats()
    # Tokens: a miss of 40, then a hit of 32 of 40.
    assert stats.prefix_cache_stats.hit_rate == pytest.approx(32 / 80)
    assert stats.num_cached_blocks >= 2 and stats.kv_cache_usage == 0.0

    assert llm.reset_prefix_cache() == stats.num_cached_blocks
    stats = llm.get_stats()
    assert stats.num_cached_blocks == 0 and stats.prefix_cache_stats.queries == 0
    again = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.get_stats().prefix_cache_stats.hit_rate == 0.0


def test_kv_cache_memory_bytes_sets_the_block_count(tiny_llama):
    hf = json.loads((tiny_llama / "config.json").read_text())
    head_size = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_block = kv_cache_bytes_per_block(hf["num_hidden_layers"], 16, hf["num_key_value_heads"],
                                         head_size, dtype_bytes=4)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=20 * per_block + 100)
    stats = llm.get_stats()
    assert (stats.num_blocks, stats.num_free_blocks) == (20, 19)
