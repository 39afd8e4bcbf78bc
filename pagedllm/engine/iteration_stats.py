"""What the engine loop reports after each iteration (`AsyncLLM` -> its stat loggers, e.g. the
server's PrometheusStatLogger): plain dataclasses, in a module of their own so that the metrics
code imports them without the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.core.sched_output import EplbStats
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.core.spec_decode_stats import SpecDecodingStats


@dataclass
class FinishedRequestStats:
    """One request that left the engine (finished or aborted)."""

    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float  # arrival (generate() called) -> last output, seconds


@dataclass
class IterationStats:
    """What happened in one engine-loop iteration (deltas, not totals)."""

    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_eplb_rebalances: int = 0
    # The imbalance of the last EPLB rebalance when one happened in this iteration, else None.
    eplb_stats: EplbStats | None = None
    # Drafts verified in this iteration (speculative decoding).
    spec_decoding_stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)


class StatLogger(Protocol):
    """Receives the engine's state after each loop iteration (called on the engine thread)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        ...

    # Optional: record_engine_info(kv_cache_bytes_per_token: int) -> None, called once when
    # the AsyncLLM is built (PrometheusStatLogger's gauge).
