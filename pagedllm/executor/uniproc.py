"""UniProcExecutor: one worker in the engine's own process."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor:
    """Create the worker, load the model; the engine then sizes and allocates the KV cache."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def kv_cache_windows(self) -> tuple[int | None, ...]:
        return self.worker.kv_cache_windows()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
