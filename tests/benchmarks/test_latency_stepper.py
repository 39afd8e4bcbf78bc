"""`bench latency`'s stepping loop calls the worker's per-step platform hooks (the CPU thread
governor) as `Worker.execute_model` does, so a shared machine's thread count adapts there too."""

from __future__ import annotations

from pagedllm import LLM
from pagedllm.benchmarks.latency import EngineStepper, run_wave
from pagedllm.benchmarks.workload import BenchRequest


class CountingPlatform:
    def __init__(self, platform) -> None:
        self.platform = platform
        self.before = self.after = 0

    def before_step(self) -> None:
        self.before += 1
        self.platform.before_step()

    def after_step(self) -> None:
        self.after += 1
        assert self.after == self.before
        self.platform.after_step()


def test_stepper_calls_platform_step_hooks(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=8 << 20)
    worker = llm.llm_engine.engine_core.executor.worker
    counting = CountingPlatform(worker.platform)
    worker.platform = counting
    stepper = EngineStepper(llm.llm_engine)
    timelines = run_wave(stepper, [BenchRequest(list(range(10, 30)), 6)], "w", None)
    assert timelines[0].num_tokens == 6
    assert counting.before == counting.after > 0
