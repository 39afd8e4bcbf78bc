"""Data-parallel routing (dp_router.py): the policies alone, then prefix-cache hit rates of two
in-process replicas under each policy against one replica (issue #43's measure: 8 groups of
requests sharing 512-token prefixes)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.dp_async_llm import DataParallelAsyncLLM
from pagedllm.engine.dp_router import (LeastLoadedRouter, PrefixAwareRouter, RoundRobinRouter,
                                       make_router)

BLOCK = 4


def _prompt(group: int, suffix: int, prefix_blocks: int = 4) -> list[int]:
    return [group + 1] * (prefix_blocks * BLOCK) + [100 + suffix] * 3


def test_prefix_aware_follows_the_longest_remembered_prefix() -> None:
    router = PrefixAwareRouter(BLOCK)
    live = [0, 1, 2]
    assert router.route(_prompt(0, 0), [0, 0, 0], live) == 0          # new: least loaded
    assert router.route(_prompt(1, 0), [1, 0, 0], live) == 1
    assert router.route(_prompt(0, 1), [1, 1, 0], live) == 0          # group 0 went to 0
    assert router.route(_prompt(1, 1), [2, 1, 0], live) == 1
    # A longer prefix routed elsewhere wins over a shorter one.
    longer = _prompt(0, 0, prefix_blocks=6)
    assert router.route(longer, [9, 9, 0], live) == 2                 # overloaded: least loaded
    assert router.route(longer + [7], [2, 2, 2], live) == 2
    assert router.route(_prompt(0, 5), [2, 2, 2], live) == 2          # now remembered on 2
    # Dead replicas and prompts without ids fall back to the least loaded live one.
    assert router.route(_prompt(1, 2), [0, 5, 1], [0, 2]) == 0
    assert router.route(None, [3, 1, 2], live) == 1
    # Shorter than one block: nothing to remember.
    assert router.route([1, 2], [4, 4, 0], live) == 2


def test_prefix_aware_overload_threshold_expiry_and_capacity() -> None:
    now = [0.0]
    router = PrefixAwareRouter(BLOCK, imbalance=2, ttl_s=10.0, capacity=8, clock=lambda: now[0])
    assert router.route(_prompt(0, 0), [0, 0], [0, 1]) == 0
    assert router.route(_prompt(0, 1), [2, 0], [0, 1]) == 0           # 2 above: still its own
    assert router.route(_prompt(0, 2), [3, 0], [0, 1]) == 1           # 3 above: overloaded
    now[0] = 11.0                                                     # expired
    assert router.route(_prompt(0, 3), [0, 0], [0, 1]) == 0
    for group in range(1, 4):                                         # 12 hashes > capacity
        router.route(_prompt(group, 0), [0, 0], [0, 1])
    assert router.cached_replica(router.prefix_hashes(_prompt(0, 0)), [0, 1]) is None


def test_least_loaded_and_round_robin() -> None:
    assert LeastLoadedRouter().route(None, [3, 1, 1], [0, 1, 2]) == 1
    rr = RoundRobinRouter()
    assert [rr.route(None, [0, 0, 0], [0, 1, 2]) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.route(None, [0, 0, 0], [0, 2]) for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError, match="round_robin"):
        make_router("random", BLOCK)


class _HitCounter:
    """A stat logger summing prefix-cache lookups of one engine."""

    def __init__(self) -> None:
        self.queries = self.hits = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.queries += iteration_stats.prefix_cache_queries
        self.hits += iteration_stats.prefix_cache_hits


def _hit_rate(tiny_llama: Path, num_replicas: int, policy: str) -> float:
    """Prefix-cache hit rate of 8 groups x 4 rounds of requests sharing 512-token prefixes,
    each round's 8 requests sent together in a shuffled order."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 500) for _ in range(512)] for _ in range(8)]
    counters = [_HitCounter() for _ in range(num_replicas)]
    engine = {"dtype": "float32", "kv_cache_memory_bytes": 64_000_000, "max_model_len": 640,
              "block_size": 16}
    params = SamplingParams(temperature=0.0, max_tokens=2)

    async def run() -> None:
        dp = DataParallelAsyncLLM.from_engine_args(
            str(tiny_llama), num_replicas, stat_loggers=lambda i: [counters[i]],
            routing_policy=policy, **engine)
        try:
            for round_index in range(4):
                groups = rng.sample(range(len(prefixes)), len(prefixes))   # arrival order
                await asyncio.gather(*(_drain(dp, {"prompt_token_ids": prefixes[g] + [
                    round_index + 1, g + 1]}, params, f"r{round_index}-{g}") for g in groups))
        finally:
            dp.shutdown()

    asyncio.run(run())
    return sum(c.hits for c in counters) / sum(c.queries for c in counters)


async def _drain(dp: DataParallelAsyncLLM, prompt, params, request_id: str) -> None:
    async for _ in dp.generate(prompt, params, request_id):
        pass


def test_prefix_aware_routing_keeps_the_single_replica_hit_rate(tiny_llama: Path) -> None:
    single = _hit_rate(tiny_llama, 1, "least_loaded")
    prefix_aware = _hit_rate(tiny_llama, 2, "prefix_aware")
    least_loaded = _hit_rate(tiny_llama, 2, "least_loaded")
    print(f"hit rate: one replica {single:.3f}, two replicas prefix_aware {prefix_aware:.3f}, "
          f"least_loaded {least_loaded:.3f}")
    assert prefix_aware >= 0.9 * single
    assert least_loaded < prefix_aware
