"""CounterShares: the counters an engine core gives each of its front ends add up to the core's
counts, gauges pass through unchanged, shares never decrease (a reset of the core's counters
included), and each front end's differences count every increment exactly once."""

from __future__ import annotations

from dataclasses import replace

from pagedllm.core.kv_cache_manager import PrefixCacheStats
from pagedllm.core.sched_output import EplbStats, KVConnectorStats
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.engine.core_stat_shares import CounterShares


def _stats(queries: int, hits: int, preemptions: int, drafts: int, per_pos: list[int],
           running: int = 0, connector: KVConnectorStats | None = None) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=running, num_waiting_reqs=1, kv_cache_usage=0.5, num_blocks=10,
        num_free_blocks=5, num_cached_blocks=2,
        prefix_cache_stats=PrefixCacheStats(queries, hits, queries // 10),
        num_preemptions=preemptions,
        spec_decoding_stats=SpecDecodingStats(drafts, 2 * drafts, sum(per_pos), per_pos),
        kv_connector_stats=connector, num_encoder_runs=drafts)


def _eplb(n: int) -> EplbStats:
    return EplbStats(n, [0, 1], [2.0, 1.5], [1.1, 1.0])


def test_shares_add_up_and_front_ends_count_each_increment_once() -> None:
    shares = CounterShares(2, _stats(5, 1, 1, 0, []), None)   # counts before: nobody's
    # (core's stats, eplb, the front end given the increments)
    timeline = [
        (_stats(25, 4, 1, 1, [1], running=3), None, 0),
        (_stats(40, 10, 3, 3, [2, 1], running=2), _eplb(1), 1),
        (_stats(40, 10, 4, 4, [3, 1, 1], running=1), _eplb(2), 1),
        (_stats(70, 30, 4, 6, [4, 2, 1], running=0), _eplb(2), 0),
    ]
    recorded = [{"queries": 0, "preemptions": 0, "drafts": 0, "per_pos": [], "rebalances": 0}
                for _ in range(2)]
    for stats, eplb, client in timeline:
        shares.give(client, stats, eplb)
        for c in (0, 1):
            mine, my_eplb = shares.view(c, stats, eplb)
            # Gauges pass through; what a front end differences only grows.
            assert (mine.num_running_reqs, mine.kv_cache_usage) == (stats.num_running_reqs,
                                                                    stats.kv_cache_usage)
            seen = recorded[c]
            assert mine.prefix_cache_stats.queries >= seen["queries"]
            assert mine.num_preemptions >= seen["preemptions"]
            seen.update(queries=mine.prefix_cache_stats.queries,
                        preemptions=mine.num_preemptions,
                        drafts=mine.spec_decoding_stats.num_drafts,
                        per_pos=mine.spec_decoding_stats.num_accepted_tokens_per_pos,
                        rebalances=my_eplb.num_rebalances if my_eplb else 0)
            assert my_eplb is None or my_eplb.imbalance_before == eplb.imbalance_before
    total = {k: sum(r[k] for r in recorded) for k in ("queries", "preemptions", "drafts",
                                                      "rebalances")}
    assert total == {"queries": 70 - 5, "preemptions": 4 - 1, "drafts": 6, "rebalances": 2}
    assert recorded[0]["queries"] == (25 - 5) + (70 - 40)
    per_pos = [a + b for a, b in zip(*(r["per_pos"] + [0] * 3 for r in recorded))]
    assert per_pos[:3] == [4, 2, 1]


def test_reset_of_the_core_counters_keeps_shares_growing() -> None:
    shares = CounterShares(2, _stats(0, 0, 0, 0, []), None)
    shares.give(0, _stats(30, 6, 2, 0, []), None)
    before = shares.view(0, _stats(30, 6, 2, 0, []), None)[0]
    # A prefix-cache reset between steps: the core's prefix counters restart at 0.
    reset = _stats(0, 0, 2, 0, [])
    shares.rebase(reset, None)
    assert shares.view(0, reset, None)[0].prefix_cache_stats == before.prefix_cache_stats
    shares.give(1, _stats(12, 3, 2, 0, []), None)
    assert shares.view(1, reset, None)[0].prefix_cache_stats.queries == 12
    assert shares.view(0, reset, None)[0].prefix_cache_stats.queries == 30
    # A reset the core did not report (no rebase): the new count is taken as all new.
    shares.give(0, _stats(5, 1, 2, 0, []), None)
    assert shares.view(0, reset, None)[0].prefix_cache_stats.queries == 35


def test_connector_counters_and_absent_features() -> None:
    connector = KVConnectorStats(loaded_blocks=2, queries=4, hits=2)
    shares = CounterShares(3, _stats(0, 0, 0, 0, [], connector=connector), None)
    later = replace(connector, loaded_blocks=7, stored_blocks=3, queries=9, hits=5)
    stats = _stats(0, 0, 0, 0, [], connector=later)
    shares.give(2, stats, None)
    assert shares.view(2, stats, None)[0].kv_connector_stats == KVConnectorStats(
        loaded_blocks=5, stored_blocks=3, queries=5, hits=3)
    assert shares.view(0, stats, None)[0].kv_connector_stats == KVConnectorStats()
    # No connector, no EPLB: stay None.
    plain = CounterShares(2, _stats(0, 0, 0, 0, []), None)
    plain.give(0, _stats(3, 1, 0, 0, []), None)
    mine, eplb = plain.view(1, _stats(3, 1, 0, 0, []), None)
    assert mine.kv_connector_stats is None and eplb is None
