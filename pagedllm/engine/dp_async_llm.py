"""DataParallelAsyncLLM: N engine replicas behind one API server (`--data-parallel-size N`).

Each replica is a full `AsyncLLM` (its own engine thread, model weights and KV cache). A new request
goes to the replica with the fewest requests in flight (ties: the lowest index), which balances
by queue length; a request stays on its replica until it finishes. It offers the subset of
AsyncLLM's interface the server uses, so `build_app` serves either.

Replicas live in this process: torch releases the GIL inside its kernels, so their steps overlap
on different cores. Replicas in their own processes (or machines) are future work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream, StatLogger
from pagedllm.engine.input_processor import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class DataParallelAsyncLLM:
    """Args: the replicas (at least one, all serving the same model)."""

    def __init__(self, replicas: Sequence[AsyncLLM]) -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.default_sampling_params = first.default_sampling_params
        self.input_processor = first.input_processor
        self._in_flight = [0] * len(self.replicas)
        self._replica_of: dict[str, int] = {}

    @classmethod
    def from_engine_args(cls, model: str, data_parallel_size: int,
                         stat_loggers: Sequence[StatLogger] = (),
                         **engine_args: Any) -> DataParallelAsyncLLM:
        """Build `data_parallel_size` replicas (raises ValueError for a size < 1)."""
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        return cls([AsyncLLM.from_engine_args(model, stat_loggers=stat_loggers, **engine_args)
                    for _ in range(data_parallel_size)])

    @property
    def dead_error(self) -> EngineDeadError | None:
        return next((r.dead_error for r in self.replicas if r.dead_error is not None), None)

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def pick_replica(self) -> int:
        """Index of the live replica with the fewest requests in flight."""
        live = [i for i, r in enumerate(self.replicas) if r.dead_error is None] or [0]
        return min(live, key=lambda i: (self._in_flight[i], i))

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """As `AsyncLLM.add_request`, on the least loaded replica (same errors)."""
        index = self.pick_replica()
        self._in_flight[index] += 1
        self._replica_of[request_id] = index
        try:
            stream = await self.replicas[index].add_request(request_id, prompt, sampling_params,
                                                            lora_request)
        except BaseException:
            self._release(request_id, index)
            raise
        stream.add_close_callback(lambda req_id, _: self._release(req_id, index))
        return stream

    def check_lora_request(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """`AsyncLLM.check_lora_request` on every replica."""
        for replica in self.replicas:
            replica.check_lora_request(lora_request)
        return lora_request

    def forget_lora(self, lora_int_id: int) -> None:
        for replica in self.replicas:
            replica.forget_lora(lora_int_id)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """As `AsyncLLM.generate`, on the least loaded replica."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` if any replica's engine loop fails."""
        for replica in self.replicas:
            replica.on_dead(callback)

    def _release(self, request_id: str, index: int) -> None:
        self._in_flight[index] -= 1
        self._replica_of.pop(request_id, None)

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            index = self._replica_of.get(req_id)
            if index is not None:
                self.replicas[index].abort(req_id)

    async def reset_prefix_cache(self) -> int:
        counts = await asyncio.gather(*(r.reset_prefix_cache() for r in self.replicas))
        return sum(counts)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout_s)
