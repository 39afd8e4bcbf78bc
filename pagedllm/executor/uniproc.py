"""UniProcExecutor: one worker in the engine's own process.

With asynchronous scheduling (`execute_model(..., non_block=True)`) the worker runs its steps in
one extra thread, in submission order, so the engine thread schedules step N+1 and processes step
N's outputs while step N+1 runs (torch releases the GIL in its kernels; on CUDA the thread only
launches them). The runner's state is touched by that thread alone; the engine thread only waits
for each step's host copies (`AsyncModelRunnerOutput.get_output`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import Worker


class AsyncStepFuture:
    """A step submitted to the model thread; `result()` is its `ModelRunnerOutput` (waits for the
    step and its tokens' host copy; re-raises what the step raised)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> ModelRunnerOutput:
        return self._future.result().get_output()


class UniProcExecutor:
    """Create the worker, load the model; the engine then sizes and allocates the KV cache."""

    supports_async_scheduling = True

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.worker.load_model()
        self._model_thread: ThreadPoolExecutor | None = None

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def kv_cache_windows(self) -> tuple[int | None, ...]:
        return self.worker.kv_cache_windows()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None,
                      non_block: bool = False) -> ModelRunnerOutput | AsyncStepFuture:
        """Run one step. Blocking: its output. `non_block`: an `AsyncStepFuture` at once, the step
        queued behind the ones submitted before (async scheduling: the worker takes the tokens
        of the previous step from the device)."""
        if not non_block:
            return self.worker.execute_model(scheduler_output, grammar_output)
        if self._model_thread is None:
            self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-model")
        return AsyncStepFuture(self._model_thread.submit(self.worker.execute_model_async,
                                                         scheduler_output, grammar_output))

    def collective_rpc(self, method: str, args: tuple = (),
                       reply_rank: int | None = None) -> list[Any]:
        """`Worker.method(*args)` on the one worker; its result in a list (as the
        distributed executors answer, one entry per rank)."""
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=True)
            self._model_thread = None
        self.worker.shutdown()   # (its KV connector's copy thread)
