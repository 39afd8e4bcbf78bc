"""Split an engine core's counters among the front ends it serves (the API-server pool).

The scheduler's stats (`SchedulerStats`, `EplbStats`) hold gauges (running, waiting, KV usage:
the state now) and counters since start (prefix-cache lookups and hits, preemptions, speculative
decoding, KV-connector blocks, encoder runs, EPLB rebalances). One front end turns the counters
into Prometheus increments by differencing the values it receives (`AsyncLLM._record`). When a
core serves N front ends (`--api-server-count N`) and each received the core's own totals, the
summed `/metrics` of the N front ends (prometheus_client's multiprocess mode) would count every
preemption up to N times.

So, with more than one front end, each front end receives its own *share* of every counter:
after each message the core sends, the increments since the previous message are given to one
front end of that message (one that has requests on the core, so it records them at once), and
every front end sees the gauges unchanged and its counters at its share. The shares add up to
the core's counts, and a share never decreases: a reset of the core's counters (a prefix-cache
reset, sleep, a weight update) starts the core's next increments from the new value, so each
front end's differences stay exact. (vLLM sends each step's counter deltas to one client for the
same reason; the core here keeps totals, which the front end differences.)
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any

from pagedllm.core.sched_output import EplbStats
from pagedllm.core.scheduler import SchedulerStats

# The fields of SchedulerStats that are counters since start (each an int or a dataclass of
# int / list-of-int counters, or None when the engine lacks the feature).
COUNTER_FIELDS = ("prefix_cache_stats", "num_preemptions", "spec_decoding_stats",
                  "kv_connector_stats", "num_encoder_runs")


def _counters(stats: SchedulerStats, eplb: EplbStats | None) -> dict[str, Any]:
    counters = {name: getattr(stats, name) for name in COUNTER_FIELDS}
    counters["num_rebalances"] = eplb.num_rebalances if eplb is not None else 0
    return counters


def _combine(a: Any, b: Any, op: str) -> Any:
    """`a + b` (op "add") or the increments from `b` to `a` (op "since": `a - b`, or all of
    `a` where `a < b`, i.e. the counter was reset), field by field; a None side is 0."""
    if a is None or b is None:
        if op == "since":
            return a
        return b if a is None else a
    if isinstance(a, int):
        if op == "add":
            return a + b
        return a - b if a >= b else a
    if isinstance(a, list):
        n = max(len(a), len(b))
        a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
        return [_combine(x, y, op) for x, y in zip(a, b)]
    if is_dataclass(a):
        return replace(a, **{f.name: _combine(getattr(a, f.name), getattr(b, f.name), op)
                             for f in fields(a)})
    raise TypeError(f"not a counter: {type(a).__name__}")


class CounterShares:
    """The counters each of `num_clients` front ends has been given (see the module docstring).

    Args:
        num_clients: front ends served by the core.
        stats, eplb: the core's stats now (their counters are not given to anyone).
    """

    def __init__(self, num_clients: int, stats: SchedulerStats,
                 eplb: EplbStats | None) -> None:
        self._given = _counters(stats, eplb)
        # Zeros of each counter's shape (the increments from a value to itself).
        zero = {name: _combine(value, value, "since") for name, value in self._given.items()}
        self._shares = [dict(zero) for _ in range(num_clients)]

    def rebase(self, stats: SchedulerStats, eplb: EplbStats | None) -> None:
        """Take the core's counters now as given (after a call that may reset them, between
        steps: nothing new is lost)."""
        self._given = _counters(stats, eplb)

    def give(self, client: int, stats: SchedulerStats, eplb: EplbStats | None) -> None:
        """Give `client` the increments since the last `give` or `rebase`."""
        now = _counters(stats, eplb)
        share = self._shares[client]
        for name, value in now.items():
            share[name] = _combine(share[name], _combine(value, self._given[name], "since"),
                                   "add")
        self._given = now

    def view(self, client: int, stats: SchedulerStats,
             eplb: EplbStats | None) -> tuple[SchedulerStats, EplbStats | None]:
        """`stats` and `eplb` as `client` receives them: the gauges as they are, the counters
        at its share.

        Raises:
            IndexError: no such client.
        """
        share = self._shares[client]
        mine = replace(stats, **{name: share[name] for name in COUNTER_FIELDS})
        if eplb is not None:
            eplb = replace(eplb, num_rebalances=share["num_rebalances"])
        return mine, eplb
