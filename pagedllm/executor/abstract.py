"""The Executor protocol the EngineCore drives, and the backend name -> class factory.

An executor owns the workers (one per rank) and hides where they live: in the engine process
(`uni`), in child processes of this machine (`mp`) or in Ray actors (`ray`). Every rank receives
every SchedulerOutput; the ModelRunnerOutput comes from the driver rank (the first TP rank of the
last pipeline stage), with a KV connector merged with every rank's failed KV loads. The KV cache
size is the minimum over the ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process or actor exited or failed; the engine cannot continue."""


class Executor(Protocol):
    """Runs one engine's workers. `__init__(config)` starts them and loads the model.

    `supports_async_scheduling` (class attribute): whether `execute_model` takes
    `non_block=True` and returns a future whose `result()` is the ModelRunnerOutput, the
    worker filling each step's inputs from the previous step's tokens on the device (only the
    uniproc executor does; see engine/engine_core.py).
    """

    supports_async_scheduling: bool

    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every rank (the minimum over the ranks)."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every rank."""

    def kv_cache_windows(self) -> tuple[int | None, ...]:
        """The KV cache groups' sliding windows (the same on every rank)."""

    def collective_rpc(self, method: str, args: tuple = (),
                       reply_rank: int | None = None) -> list[Any]:
        """`Worker.method(*args)` on every rank; the results in rank order (only `reply_rank`'s
        when given, None for the others).

        Raises:
            WorkerDiedError: a worker died or raised (distributed executors; the uniproc
                executor raises what the worker raised).
        """

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Run one step on every rank (`ModelRunner.execute_model(scheduler_output)` then
        `sample_tokens(grammar_output)`, in one call per rank); the driver rank's output.

        Raises:
            WorkerDiedError: a worker died or raised (distributed executors).
        """

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


class DistributedExecutorBase:
    """The Executor steps for executors whose workers answer `collective_rpc` (mp and Ray).

    Subclasses set `config` and `driver_rank` and implement `collective_rpc(method, args, reply_rank)`, which
    calls `method(*args)` on every rank and returns the answers by rank (only `reply_rank`'s
    when given), raising WorkerDiedError when a worker died or raised.
    """

    config: EngineConfig
    driver_rank: int
    # NOTE(async_scheduling): the workers would need a non-blocking execute_model RPC and each
    # rank the previous step's tokens on its device (pipeline stages other than the last never
    # sample); not built yet, so the engine refuses async scheduling with mp and Ray.
    supports_async_scheduling = False

    def collective_rpc(self, method: str, args: tuple = (),
                       reply_rank: int | None = None) -> list[Any]:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        for line in self.collective_rpc("layout_summary"):
            logger.info("%s", line)

    def kv_cache_windows(self) -> tuple[int | None, ...]:
        windows = set(self.collective_rpc("kv_cache_windows"))
        if len(windows) != 1:
            raise RuntimeError(f"ranks disagree on the KV cache groups: {sorted(windows)}")
        return windows.pop()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """The driver rank's output; with a KV connector, every rank's failed KV loads
        merged into its `invalid_block_ids` (`merge_invalid_block_ids`)."""
        if self.config.kv_transfer_config is None:
            return self.collective_rpc("execute_model", (scheduler_output, grammar_output),
                                       reply_rank=self.driver_rank)[self.driver_rank]
        replies = self.collective_rpc("execute_model_reporting_kv",
                                      (scheduler_output, grammar_output, self.driver_rank))
        return merge_invalid_block_ids(replies, self.driver_rank)


def merge_invalid_block_ids(replies: list[Any], driver: int) -> ModelRunnerOutput:
    """The driver rank's ModelRunnerOutput with every rank's failed KV loads in its
    `invalid_block_ids` (the idea of vLLM's KVOutputAggregator, which merges the workers'
    `kv_connector_output`). Each rank loads its own shard (its TP heads, its PP stage's
    layers) of the same device blocks, so a block whose load failed on any rank holds zeros
    there and the scheduler must recompute it as if every rank had failed it.

    Args:
        replies: per global rank, `Worker.execute_model_reporting_kv`'s answer: the driver's
            ModelRunnerOutput at index `driver`, a set of device block ids (ints) elsewhere.
        driver: the driver's global rank.

    Raises:
        TypeError: the driver's reply is not a ModelRunnerOutput, or another rank's not a set.
    """
    output = replies[driver]
    if not isinstance(output, ModelRunnerOutput):
        raise TypeError(f"driver rank {driver} answered {type(output).__name__}, "
                        "not a ModelRunnerOutput")
    for rank, failed in enumerate(replies):
        if rank == driver:
            continue
        if not isinstance(failed, set):
            raise TypeError(f"rank {rank} answered {type(failed).__name__}, not the set of "
                            "block ids whose KV loads failed")
        if failed:
            logger.warning("KV connector: rank %d failed to load blocks %s", rank,
                           sorted(failed))
            output.invalid_block_ids = output.invalid_block_ids | failed
    return output


def get_executor_class(backend: str) -> type:
    """Executor class of `distributed_executor_backend` ("uni", "mp" or "ray").

    Raises:
        ValueError: for an unknown backend name.
    """
    if backend == "uni":
        from pagedllm.executor.uniproc import UniProcExecutor
        return UniProcExecutor
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    if backend == "ray":
        from pagedllm.executor.ray import RayExecutor
        return RayExecutor
    raise ValueError(f"unknown distributed_executor_backend {backend!r}; use 'uni', 'mp' or 'ray'")


def driver_rank(config: EngineConfig) -> int:
    """Global rank whose ModelRunnerOutput the engine uses: TP rank 0 of the last PP stage."""
    pc = config.parallel_config
    return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
