"""AsyncLLM in-process: concurrent streams, per-request errors, abort, engine failure, shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError, IterationStats

ENGINE_KWARGS = {"dtype": "float32", "kv_cache_memory_bytes": 16_000_000}
TIMEOUT_S = 30


class RecordingStatLogger:
    """Keeps every record; raises on record number `fail_at` (to break the engine loop)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.records: list[tuple[SchedulerStats, IterationStats]] = []
        self.fail_at = fail_at

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.records.append((scheduler_stats, iteration_stats))
        if self.fail_at is not None and len(self.records) >= self.fail_at:
            raise RuntimeError("stat logger exploded")


async def _collect(async_llm: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    outputs = [out async for out in async_llm.generate(prompt, params, request_id)]
    return outputs


def test_concurrent_streams_match_offline_and_errors_stay_local(tiny_llama: Path) -> None:
    prompts = [f"prompt {i} " * (1 + i % 3) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = [o.outputs[0].text for o in
                LLM(str(tiny_llama), **ENGINE_KWARGS).generate(prompts, params, use_tqdm=False)]
    stats = RecordingStatLogger()

    async def run():
        async_llm = AsyncLLM.from_engine_args(str(tiny_llama), stat_loggers=[stats],
                                              **ENGINE_KWARGS)
        try:
            tasks = [_collect(async_llm, p, params, f"r{i}") for i, p in enumerate(prompts)]
            tasks.append(_collect(async_llm, [10**9], params, "bad"))
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                          TIMEOUT_S)
        finally:
            async_llm.shutdown()

    results = asyncio.run(run())
    assert isinstance(results[-1], ValueError) and "vocabulary" in str(results[-1])
    for outputs, text in zip(results[:-1], expected):
        assert outputs[-1].finished and outputs[-1].outputs[0].text == text
        assert all(not o.finished for o in outputs[:-1])
    finished = [f for _, it in stats.records for f in it.finished_requests]
    assert sorted(f.finish_reason for f in finished) == ["length"] * len(prompts)
    assert sum(it.num_generation_tokens for _, it in stats.records) == 12 * len(prompts)
    assert sum(len(it.time_to_first_tokens_s) for _, it in stats.records) == len(prompts)


def test_cancel_aborts_and_frees_blocks(tiny_llama: Path) -> None:
    stats = RecordingStatLogger()

    async def run():
        async_llm = AsyncLLM.from_engine_args(str(tiny_llama), stat_loggers=[stats],
                                              **ENGINE_KWARGS)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
            async for out in async_llm.generate("a long one", params, "long"):
                if len(out.outputs[0].token_ids) >= 3:
                    break  # closing the iterator aborts the request
            for _ in range(200):
                if stats.records[-1][0].num_running_reqs == 0:
                    break
                await asyncio.sleep(0.01)
            # The id is free again and the engine still serves.
            short = SamplingParams(temperature=0.0, max_tokens=2)
            return await asyncio.wait_for(_collect(async_llm, "x", short, "long"), TIMEOUT_S)
        finally:
            async_llm.shutdown()

    outputs = asyncio.run(run())
    assert outputs[-1].finished
    aborted = [f for _, it in stats.records for f in it.finished_requests
               if f.finish_reason == "abort"]
    assert len(aborted) == 1 and aborted[0].num_generation_tokens >= 3
    idle = [s for s, _ in stats.records if s.num_running_reqs == 0 and s.num_waiting_reqs == 0]
    assert idle and idle[-1].kv_cache_usage == 0.0


def test_engine_loop_failure_fails_every_request(tiny_llama: Path) -> None:
    async def run():
        async_llm = AsyncLLM.from_engine_args(str(tiny_llama),
                                              stat_loggers=[RecordingStatLogger(fail_at=3)],
                                              **ENGINE_KWARGS)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
            results = await asyncio.wait_for(asyncio.gather(
                *[_collect(async_llm, f"p{i}", params, str(i)) for i in range(4)],
                return_exceptions=True), TIMEOUT_S)
            with pytest.raises(EngineDeadError):
                await _collect(async_llm, "later", params, "later")
            with pytest.raises(EngineDeadError):
                await async_llm.reset_prefix_cache()
            return results, async_llm.dead_error
        finally:
            async_llm.shutdown()
            async_llm.shutdown()  # idempotent

    results, dead = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert "stat logger exploded" in str(dead)


def test_shutdown_fails_pending_requests(tiny_llama: Path) -> None:
    async def run():
        async_llm = AsyncLLM.from_engine_args(str(tiny_llama), **ENGINE_KWARGS)
        params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        task = asyncio.ensure_future(_collect(async_llm, "pending", params, "p"))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(async_llm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, TIMEOUT_S)
        assert not async_llm.is_running

    asyncio.run(run())
