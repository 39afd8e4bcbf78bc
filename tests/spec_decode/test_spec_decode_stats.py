"""Acceptance counters per draft position: `SpecDecodingStats` alone, through `LLM.get_stats()`
and as vLLM's `spec_decode_*` metrics on /metrics."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, SamplingParams
from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.metrics import PrometheusStatLogger

PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], [9, 10, 11] * 10, list(range(20, 61))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SPEC = {"method": "suffix", "num_speculative_tokens": 3}


def test_per_position_counts_copy_and_delta():
    stats = SpecDecodingStats()
    stats.observe_draft(3, 2)
    before = stats.copy()
    stats.observe_draft(2, 0)
    stats.observe_draft(4, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    assert before.num_accepted_tokens_per_pos == [1, 1, 0]     # a copy, not a view
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 6)
    assert stats.acceptance_rate_per_pos == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    delta = stats.minus(before)
    assert (delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens) == (2, 6, 4)
    assert delta.num_accepted_tokens_per_pos == [1, 1, 1, 1]
    assert SpecDecodingStats().minus(stats).num_drafts == 0    # counters reset: no negatives


def _check_consistent(stats: SpecDecodingStats, k: int) -> None:
    per_pos = stats.num_accepted_tokens_per_pos
    assert stats.num_drafts > 0 and len(per_pos) <= k
    assert sum(per_pos) == stats.num_accepted_tokens > 0
    # A position is accepted only after every earlier one.
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= stats.num_drafts


def test_llm_get_stats_per_position(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config=SPEC)
    # Twice: the second round is drafted from the first's outputs (the global suffix tree).
    for _ in range(2):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    _check_consistent(llm.get_stats().spec_decoding_stats, 3)


def test_metrics_equal_engine_counters(tiny_checkpoints):
    metrics = PrometheusStatLogger("m")

    async def run():
        async_llm = AsyncLLM.from_engine_args(
            str(tiny_checkpoints["llama"]), stat_loggers=[metrics], dtype="float32",
            kv_cache_memory_bytes=8 << 20, speculative_config=SPEC)
        try:
            async def drain(prompt, request_id):
                async for _ in async_llm.generate({"prompt_token_ids": prompt}, PARAMS,
                                                  request_id):
                    pass
            for round_ in range(2):
                await asyncio.wait_for(asyncio.gather(
                    *(drain(p, f"r{round_}.{i}") for i, p in enumerate(PROMPTS))), 120)
            return async_llm.engine.get_stats().spec_decoding_stats
        finally:
            async_llm.shutdown()

    stats = asyncio.run(run())
    _check_consistent(stats, 3)
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            samples[(s.name, s.labels.get("position"))] = s.value
    assert samples[("pagedllm:spec_decode_num_drafts_total", None)] == stats.num_drafts
    assert samples[("pagedllm:spec_decode_num_draft_tokens_total", None)] == \
        stats.num_draft_tokens
    assert samples[("pagedllm:spec_decode_num_accepted_tokens_total", None)] == \
        stats.num_accepted_tokens
    for position, n in enumerate(stats.num_accepted_tokens_per_pos):
        assert samples[("pagedllm:spec_decode_num_accepted_tokens_per_pos_total",
                        str(position))] == n
