"""EPLB's imbalance reaching /metrics (issue #19, phase 3).

Oracles: the worker's own EplbState (in one process: the gauges and the counter equal its
imbalance arrays and rebalance count); over two worker processes, the metric exists for every
MoE layer with values inside [1, ep_size] and the rebalances are counted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import SamplingParams
from pagedllm.config import EPLBConfig
from pagedllm.distributed.parallel_state import (ExpertParallelLayout, get_tp_group,
                                                 set_expert_parallel_layout)
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.metrics import PrometheusStatLogger
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.worker.eplb_state import EplbState
from tests.distributed.common import ENGINE_ARGS, PROMPTS
from tests.models.test_moe import _build

EPLB = dict(enable_expert_parallel=True, enable_eplb=True,
            eplb_config={"window_size": 8, "step_interval": 3, "num_redundant_experts": 2})
NUM_LAYERS = 4  # tests/models/test_moe.py's _BASE
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, byte_level_tokenizer_dir):
    return _build("mixtral", tmp_path_factory.mktemp("eplb_metrics") / "mixtral",
                  byte_level_tokenizer_dir)


def _serve(path: Path, **parallel) -> tuple[PrometheusStatLogger, object]:
    """Generate PROMPTS through an AsyncLLM with a PrometheusStatLogger; returns the logger
    and, for the in-process executor, the worker's EplbState (else None)."""
    metrics = PrometheusStatLogger("m")
    params = SamplingParams(max_tokens=12, temperature=0.0)

    async def run():
        async_llm = AsyncLLM.from_engine_args(str(path), stat_loggers=[metrics], **ENGINE_ARGS,
                                              **parallel)
        try:
            streams = [_drain(async_llm, p, params, f"r{i}") for i, p in enumerate(PROMPTS)]
            await asyncio.wait_for(asyncio.gather(*streams), TIMEOUT_S)
            executor = async_llm.engine.engine_core.executor
            worker = getattr(executor, "worker", None)
            return None if worker is None else worker.model_runner.eplb
        finally:
            async_llm.shutdown()

    return metrics, asyncio.run(run())


async def _drain(async_llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str):
    async for _ in async_llm.generate(prompt, params, request_id):
        pass


def _samples(metrics: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _imbalance(samples, layer: int, when: str) -> float | None:
    return samples.get(("pagedllm:eplb_imbalance", (("layer", str(layer)), ("when", when))))


def test_take_stats_reports_each_rebalance_once():
    set_expert_parallel_layout(ExpertParallelLayout(True, 2, count_expert_load=True))
    try:
        layers = [FusedMoE(8, 2, 16, 12, renormalize=True) for _ in range(2)]
    finally:
        set_expert_parallel_layout(ExpertParallelLayout())
    eplb = EplbState(layers, EPLBConfig(window_size=2, step_interval=2, num_redundant_experts=2),
                     get_tp_group(), layer_ids=[1, 3])
    hidden, logits = torch.randn(32, 16), torch.randn(32, 8)
    assert eplb.take_stats() is None
    for layer in layers:
        layer(hidden, logits)
    assert not eplb.step() and eplb.take_stats() is None
    assert eplb.step()
    stats = eplb.take_stats()
    assert stats is not None and stats.num_rebalances == 1 and stats.layer_ids == [1, 3]
    assert stats.imbalance_before == eplb.imbalance_before.tolist()
    assert stats.imbalance_after == eplb.imbalance_after.tolist()
    assert eplb.take_stats() is None
    eplb.reset()
    assert eplb.num_rebalances == 0 and eplb.take_stats() is None
    with pytest.raises(ValueError, match="1 layer_ids for 2 MoE layers"):
        EplbState(layers, EPLBConfig(), get_tp_group(), layer_ids=[0])


def test_eplb_metrics_equal_the_workers_state(mixtral):
    """One process (EP size 1): every rebalance is counted and the gauges hold the worker's
    last imbalance for each decoder layer."""
    metrics, eplb = _serve(mixtral, **EPLB)
    samples = _samples(metrics)
    assert eplb.num_rebalances >= 2
    assert samples[("pagedllm:eplb_rebalances_total", ())] == eplb.num_rebalances
    assert eplb.layer_ids == list(range(NUM_LAYERS))
    for i, layer in enumerate(eplb.layer_ids):
        assert _imbalance(samples, layer, "before") == pytest.approx(eplb.imbalance_before[i])
        assert _imbalance(samples, layer, "after") == pytest.approx(eplb.imbalance_after[i])


def test_eplb_metrics_without_eplb_stay_empty(mixtral):
    metrics, _ = _serve(mixtral, enable_expert_parallel=True)
    samples = _samples(metrics)
    assert samples[("pagedllm:eplb_rebalances_total", ())] == 0
    assert not any(name == "pagedllm:eplb_imbalance" for name, _ in samples)


def test_eplb_metrics_over_two_ranks(mixtral):
    """Two worker processes (mp): the driver rank's stats cross the pipe to the engine."""
    metrics, _ = _serve(mixtral, tensor_parallel_size=2, distributed_executor_backend="mp",
                        **EPLB)
    samples = _samples(metrics)
    assert samples[("pagedllm:eplb_rebalances_total", ())] >= 2
    before = [_imbalance(samples, layer, "before") for layer in range(NUM_LAYERS)]
    after = [_imbalance(samples, layer, "after") for layer in range(NUM_LAYERS)]
    assert all(v is not None and 1.0 <= v <= 2.0 + 1e-9 for v in before + after)
    # Two ranks never split random routing exactly evenly in every layer.
    assert max(before) > 1.0
