"""Prometheus metrics of the server (GET /metrics), with vLLM's metric names under `pagedllm:`.

`PrometheusStatLogger` is an `AsyncLLM` stat logger: the engine thread calls `record` after each
loop iteration (prometheus_client is thread-safe). It owns its own `CollectorRegistry`, so several
servers or tests in one process never share or clash over metrics. With data-parallel replicas
each replica records through `for_engine(i)`: the gauges (running, waiting, KV usage) carry an
`engine` label per replica (vLLM's label), so no replica overwrites another's, while counters and
histograms add up over the replicas.

Several API-server processes (`--api-server-count N`, api_server_pool.py) answer /metrics for
the whole server through prometheus_client's multiprocess mode, as vLLM does: the pool makes a
private folder for `PROMETHEUS_MULTIPROC_DIR` before it starts the API servers
(`setup_multiprocess_metrics`, removed at exit), every API server's metrics write their values
there, and /metrics of any of them renders all of them: counters and histograms summed over the
API servers (each counts the requests it served; an engine core gives each API server its own
share of the core's counters, engine/core_stat_shares.py, so they add up to the core's count),
the engine gauges (`multiprocess_mode="mostrecent"`, vLLM's choice) the value written last by
any API server for each replica, since every API server receives the same core's gauges and
must not add them up.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, values)
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:   # (annotations only: a light import for the API-server pool's launcher)
    from pagedllm.core.scheduler import SchedulerStats
    from pagedllm.engine.iteration_stats import IterationStats

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. Finer at the low end than vLLM's buckets: small models on CPU answer in milliseconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "abort")

logger = logging.getLogger(__name__)


def multiprocess_dir() -> str | None:
    """The folder of prometheus_client's multiprocess mode in this process (None: off)."""
    # prometheus_client's switch (read when it is imported); it also honours the lower-case name.
    return (os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            or os.environ.get("prometheus_multiproc_dir"))


def setup_multiprocess_metrics() -> Callable[[], None]:
    """Turn on prometheus_client's multiprocess mode for the processes this one starts from now
    (spawned: they import prometheus_client with the variable set): a new private folder (mode
    0700) as `PROMETHEUS_MULTIPROC_DIR`, unless the user set one (used as it is, with vLLM's
    warning: it must be emptied between runs).

    Returns:
        the clean-up, to call once those processes have ended: removes the folder it made and
        the variable.
    """
    if multiprocess_dir() is not None:
        logger.warning("PROMETHEUS_MULTIPROC_DIR is set by the user (%s): it must be emptied "
                       "between runs, or /metrics shows the counters of earlier runs too",
                       multiprocess_dir())
        return lambda: None
    folder = tempfile.mkdtemp(prefix="pagedllm-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder

    def clean_up() -> None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") == folder:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(folder, ignore_errors=True)
    return clean_up


class PrometheusStatLogger:
    """Engine metrics for one served model.

    With `PROMETHEUS_MULTIPROC_DIR` set before prometheus_client was imported (the API-server
    pool's processes), `render` shows the metrics of every process writing to that folder (see
    the module docstring); one PrometheusStatLogger per process then.

    Args:
        model_name: value of the `model_name` label on every metric.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels, registry = ["model_name"], self.registry
        # Multiprocess mode: the metrics above write to the folder; /metrics reads all of it.
        self._render_registry = registry
        if multiprocess_dir() is not None:
            if values.ValueClass is values.MutexValue:
                logger.warning("PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was "
                               "imported: /metrics shows this process's metrics only")
            else:
                self._render_registry = CollectorRegistry()
                MultiProcessCollector(self._render_registry)

        def gauge(name: str, doc: str) -> Gauge:     # a family: one series per engine
            return Gauge(name, doc, ["model_name", "engine"], registry=registry,
                         multiprocess_mode="mostrecent")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        self.num_requests_running = gauge("pagedllm:num_requests_running",
                                          "Requests in the running batch.")
        self.num_requests_waiting = gauge("pagedllm:num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("pagedllm:kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_cache_bytes_per_token = gauge(
            "pagedllm:kv_cache_bytes_per_token",
            "KV cache bytes one token takes on a rank, over every layer (an MLA latent, a DSA "
            "indexer key and int8 scales included; the largest over the ranks).")
        self.prompt_tokens = counter("pagedllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("pagedllm:generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("pagedllm:num_preemptions", "Preemptions (recompute).")
        self.prefix_cache_queries = counter("pagedllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("pagedllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        # The KV connector's tier (docs/kv_connectors.md), in blocks; fed from the cumulative
        # `KVConnectorStats` (the last values seen per engine).
        self.kv_connector = {
            "queries": counter("pagedllm:kv_offload_queries",
                               "Blocks looked up in the KV tier after a device-cache miss."),
            "hits": counter("pagedllm:kv_offload_hits", "Blocks found in the KV tier."),
            "loaded_blocks": counter("pagedllm:kv_offload_loaded_blocks",
                                     "Blocks loaded from the KV tier into the device cache."),
            "stored_blocks": counter("pagedllm:kv_offload_stored_blocks",
                                     "Blocks written to the KV tier."),
            "evicted_blocks": counter("pagedllm:kv_offload_evicted_blocks",
                                      "Blocks dropped from the KV tiers (LRU)."),
            "disk_loaded_blocks": counter("pagedllm:kv_offload_disk_loaded_blocks",
                                          "Of the loaded blocks, those read from the disk "
                                          "tier."),
            "disk_stored_blocks": counter("pagedllm:kv_offload_disk_stored_blocks",
                                          "Blocks written to the disk tier."),
        }
        self._last_kv_connector: dict[int, dict[str, int]] = {}
        self.spec_decode_num_drafts = counter("pagedllm:spec_decode_num_drafts",
                                              "Requests' steps that verified draft tokens.")
        self.spec_decode_num_draft_tokens = counter("pagedllm:spec_decode_num_draft_tokens",
                                                    "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "pagedllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at `position` (0 = the first draft) was accepted.",
            ["model_name", "position"], registry=registry)
        self.time_to_first_token = histogram("pagedllm:time_to_first_token_seconds",
                                             "Arrival to first generated token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("pagedllm:inter_token_latency_seconds",
                                             "Time between consecutive output tokens.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("pagedllm:e2e_request_latency_seconds",
                                             "Arrival to finish (or abort).", _E2E_BUCKETS)
        success = Counter("pagedllm:request_success", "Finished requests by finish_reason.",
                          ["model_name", "finished_reason"], registry=registry)
        self.request_success = {reason: success.labels(model_name, reason)
                                for reason in FINISH_REASONS}
        self._success = success
        self._model_name = model_name
        self._add_engine(0)
        self.eplb_rebalances = counter("pagedllm:eplb_rebalances",
                                       "Expert rebalances done by EPLB.")
        # One series per MoE layer and side: at most 2 x num_layers, set at each rebalance.
        self.eplb_imbalance = Gauge(
            "pagedllm:eplb_imbalance",
            "Per MoE layer, max / mean over the EP ranks of the tokens routed to each rank's "
            "experts in the window of the last EPLB rebalance, under the placement before and "
            "after it (1 = balanced).", ["model_name", "layer", "when"], registry=registry,
            multiprocess_mode="mostrecent")

    def for_engine(self, engine: int) -> EngineStatLogger:
        """The stat logger of data-parallel replica `engine` (its gauges labelled with it)."""
        self._add_engine(engine)
        return EngineStatLogger(self, engine)

    def _add_engine(self, engine: int) -> None:
        """Show `engine`'s gauge series (at 0) before its first record."""
        for family in (self.num_requests_running, self.num_requests_waiting,
                       self.kv_cache_usage):
            family.labels(self._model_name, str(engine))

    def record_engine_info(self, kv_cache_bytes_per_token: int, engine: int = 0) -> None:
        """Set replica `engine`'s start-up facts (its KV cache bytes per token)."""
        self.kv_cache_bytes_per_token.labels(self._model_name, str(engine)).set(
            kv_cache_bytes_per_token)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats,
               engine: int = 0) -> None:
        """Record one engine-loop iteration of replica `engine`."""
        label = (self._model_name, str(engine))
        self.num_requests_running.labels(*label).set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.labels(*label).set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage.labels(*label).set(scheduler_stats.kv_cache_usage)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        self.num_preemptions.inc(iteration_stats.num_preemptions)
        self.prefix_cache_queries.inc(iteration_stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(iteration_stats.prefix_cache_hits)
        kv = scheduler_stats.kv_connector_stats
        if kv is not None:
            last = self._last_kv_connector.setdefault(engine, {})
            for name, counter in self.kv_connector.items():
                value = getattr(kv, name)
                counter.inc(max(0, value - last.get(name, 0)))
                last[name] = value
        self.eplb_rebalances.inc(iteration_stats.num_eplb_rebalances)
        spec = iteration_stats.spec_decoding_stats
        if spec.num_drafts:
            self.spec_decode_num_drafts.inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
            for position, n in enumerate(spec.num_accepted_tokens_per_pos):
                self.spec_decode_num_accepted_tokens_per_pos.labels(
                    self._model_name, str(position)).inc(n)
        eplb = iteration_stats.eplb_stats
        if eplb is not None:
            for layer, before, after in zip(eplb.layer_ids, eplb.imbalance_before,
                                            eplb.imbalance_after):
                self.eplb_imbalance.labels(self._model_name, str(layer), "before").set(before)
                self.eplb_imbalance.labels(self._model_name, str(layer), "after").set(after)
        for ttft in iteration_stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_s:
            self.inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.e2e_request_latency.observe(finished.e2e_latency_s)
            counter = self.request_success.get(finished.finish_reason)
            if counter is None:
                counter = self._success.labels(self._model_name, finished.finish_reason)
            counter.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self._render_registry)


class EngineStatLogger:
    """One replica's view of a `PrometheusStatLogger` (a `StatLogger`)."""

    def __init__(self, metrics: PrometheusStatLogger, engine: int) -> None:
        self.metrics, self.engine = metrics, engine

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.metrics.record(scheduler_stats, iteration_stats, self.engine)

    def record_engine_info(self, kv_cache_bytes_per_token: int) -> None:
        self.metrics.record_engine_info(kv_cache_bytes_per_token, self.engine)
