"""Data-parallel replicas whose engine cores run in processes of one machine share its cores out
among them (`ParallelConfig.machine_slot`): replica r's workers are the machine's processes after
those of replicas 0..r-1, where every replica used to plan its threads as the machine's only
process and all of them bound to the same cores."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.dp_async_llm import DataParallelAsyncLLM
from pagedllm.parallel_config import ParallelConfig


def test_machine_slot_counts_the_other_replicas_workers() -> None:
    assert ParallelConfig().machine_slot(0, 1) == (0, 1)
    assert ParallelConfig(data_parallel_size_local=3,
                          data_parallel_rank_local=2).machine_slot(0, 1) == (2, 3)
    # Two workers a replica (tp=2): replica 1's second worker is process 3 of 4.
    tp2 = ParallelConfig(tensor_parallel_size=2, data_parallel_size_local=2,
                         data_parallel_rank_local=1, cpu_threads_bind="nobind")
    assert tp2.machine_slot(1, 2) == (3, 4)


@pytest.mark.parametrize("size, rank", [(0, 0), (2, 2), (2, -1)])
def test_a_replica_index_outside_the_replicas_is_refused(size: int, rank: int) -> None:
    with pytest.raises(ValueError, match="data_parallel_rank_local"):
        ParallelConfig(data_parallel_size_local=size, data_parallel_rank_local=rank)


def test_cpu_threads_bind_gives_one_list_per_replica_process() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    lists = f"{cpus[0]}|{cpus[1]}"
    assert ParallelConfig(cpu_threads_bind=lists, data_parallel_size_local=2,
                          data_parallel_rank_local=1).cpu_threads_bind == lists
    with pytest.raises(ValueError, match="local data-parallel replicas"):
        ParallelConfig(cpu_threads_bind=str(cpus[0]), data_parallel_size_local=2)


def test_replicas_in_their_own_processes_bind_disjoint_cpus(tiny_llama: Path,
                                                            monkeypatch) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.delenv("PAGEDLLM_CPU_THREADS", raising=False)   # (it leaves affinity alone)
    dp = DataParallelAsyncLLM.from_engine_args(
        str(tiny_llama), 2, multiprocess_mode=True, dtype="float32",
        kv_cache_memory_bytes=16_000_000, routing_policy="round_robin")
    try:
        bound = [os.sched_getaffinity(r.engine.engine_core.pid) for r in dp.replicas]
        assert all(bound) and not bound[0] & bound[1], bound

        async def run() -> list[list[int]]:
            outs = []
            for i in range(2):    # round robin: one request on each replica
                async for out in dp.generate({"prompt_token_ids": [5, 6, 7]},
                                             SamplingParams(temperature=0.0, max_tokens=3),
                                             f"r{i}"):
                    pass
                outs.append(out.outputs[0].token_ids)
            return outs

        first, second = asyncio.run(run())
        assert first == second and len(first) == 3
    finally:
        dp.shutdown()
