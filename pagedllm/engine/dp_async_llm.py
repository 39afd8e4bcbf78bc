"""DataParallelAsyncLLM: N engine replicas behind one API server (`--data-parallel-size N`).

Each replica is a full `AsyncLLM` (its own engine thread, model weights and KV cache). A new request
goes to the replica its router picks (dp_router.py: by default the one most likely to hold the
prompt's prefix in its KV cache, unless it is overloaded, else the one with the fewest requests
in flight); a request stays on its replica until it finishes. It offers the subset of AsyncLLM's
interface the server uses, so `build_app` serves either.

By default the replicas live in this process: torch releases the GIL inside its kernels, so
their steps overlap on different cores. With `multiprocess_mode=True` each replica's engine core
runs in its own process (engine/core_client.py; started together), while their front ends
(tokenization, detokenization, routing) stay here. Replicas on other machines (Ray) are future
work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream, StatLogger
from pagedllm.engine.dp_router import LeastLoadedRouter, Router, make_router
from pagedllm.engine.input_processor import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class DataParallelAsyncLLM:
    """Args: the replicas (at least one, all serving the same model) and the router (None:
    least loaded)."""

    def __init__(self, replicas: Sequence[AsyncLLM], router: Router | None = None) -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        self.replicas = list(replicas)
        self.router = router or LeastLoadedRouter()
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
                         stat_loggers: Callable[[int], Sequence[StatLogger]] = lambda i: (),
                         routing_policy: str = "prefix_aware",
                         **engine_args: Any) -> DataParallelAsyncLLM:
        """Build `data_parallel_size` replicas, replica i with `stat_loggers(i)`, routed by
        `routing_policy` (dp_router.ROUTING_POLICIES).

        Raises:
            ValueError: a size < 1 or an unknown policy (before any replica loads).
        """
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        router = make_router(routing_policy, engine_args.get("block_size", 16))

        def build(i: int) -> AsyncLLM:
            return AsyncLLM.from_engine_args(model, stat_loggers=stat_loggers(i), **engine_args)

        if not engine_args.get("multiprocess_mode"):
            return cls([build(i) for i in range(data_parallel_size)], router)
        # Each replica's core loads in its own process: start them all at once.
        with concurrent.futures.ThreadPoolExecutor(data_parallel_size) as pool:
            futures = [pool.submit(build, i) for i in range(data_parallel_size)]
            concurrent.futures.wait(futures)
        replicas = [f.result() for f in futures if f.exception() is None]
        for f in futures:
            if f.exception() is not None:
                for replica in replicas:
                    replica.shutdown()
                raise f.exception()
        return cls(replicas, router)

    @property
    def dead_error(self) -> EngineDeadError | None:
        """None while every replica lives; else an error naming the dead replicas (a server
        whose replica died stops, as one whose only engine died)."""
        dead = [(i, r.dead_error) for i, r in enumerate(self.replicas)
                if r.dead_error is not None]
        if not dead:
            return None
        return EngineDeadError("; ".join(f"data-parallel replica {i}: {e}" for i, e in dead))

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def pick_replica(self, prompt: PromptType | None = None) -> int:
        """Index of the live replica the router picks for `prompt` (by its token ids when the
        prompt carries them, as the server's do)."""
        live = [i for i, r in enumerate(self.replicas) if r.dead_error is None] or [0]
        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        return self.router.route(token_ids, self._in_flight, live)

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams,
                          lora_request: LoRARequest | None = None,
                          priority: int = 0) -> RequestStream:
        """As `AsyncLLM.add_request`, on the replica the router picks (same errors)."""
        index = self.pick_replica(prompt)
        self._in_flight[index] += 1
        self._replica_of[request_id] = index
        try:
            stream = await self.replicas[index].add_request(request_id, prompt, sampling_params,
                                                            lora_request, priority)
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
        """As `AsyncLLM.generate`, on the replica the router picks."""
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
