"""DataParallelAsyncLLM: N engine replicas behind one API server (`--data-parallel-size N`).

Each replica is a full `AsyncLLM` (its own engine thread, model weights and KV cache). A new request
goes to the replica its router picks (dp_router.py: by default the one most likely to hold the
prompt's prefix in its KV cache, unless it is overloaded, else the one with the fewest requests
in flight); a request stays on its replica until it finishes. It offers the subset of AsyncLLM's
interface the server uses, so `build_app` serves either.

By default the replicas live in this process: torch releases the GIL inside its kernels, so
their steps overlap on different cores. With `multiprocess_mode=True` each replica's engine core
runs in its own process (engine/core_client.py; started together), while their front ends
(tokenization, detokenization, routing) stay here. With `data_parallel_backend="ray"` each
replica's core is a Ray actor on any node of a Ray cluster (engine/core_ray.py; implies
multiprocess mode), talking to this front end over ZeroMQ TCP with CURVE.
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

# `--data-parallel-backend`: replicas' engine cores on this machine, or Ray actors (vLLM's names).
DATA_PARALLEL_BACKENDS = ("mp", "ray")


class DataParallelAsyncLLM:
    """Args: the replicas (at least one, all serving the same model), the router (None:
    least loaded), and what to run after the replicas' shutdown (e.g. free their Ray
    placement)."""

    def __init__(self, replicas: Sequence[AsyncLLM], router: Router | None = None,
                 on_shutdown: Callable[[], None] | None = None) -> None:
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
        self._on_shutdown = on_shutdown

    @classmethod
    def from_engine_args(cls, model: str, data_parallel_size: int,
                         stat_loggers: Callable[[int], Sequence[StatLogger]] = lambda i: (),
                         routing_policy: str = "prefix_aware",
                         data_parallel_backend: str = "mp",
                         data_parallel_address: str | None = None,
                         core_launchers: Sequence[Any] | None = None,
                         **engine_args: Any) -> DataParallelAsyncLLM:
        """Build `data_parallel_size` replicas, replica i with `stat_loggers(i)`, routed by
        `routing_policy` (dp_router.ROUTING_POLICIES); `data_parallel_backend` "mp" (cores in
        this process, or in processes of this machine with `multiprocess_mode`) or "ray" (each
        core a Ray actor; `data_parallel_address`: the address of this machine the replicas
        connect to, default the one Ray knows this node by). `core_launchers`: one
        `core_client.CoreLauncher` per replica, for cores started elsewhere (the API-server
        pool's); overrides the backend.

        Raises:
            ValueError: a size < 1, an unknown policy or backend (before any replica loads).
            ImportError: "ray" without Ray installed.
            RuntimeError: the Ray cluster cannot place the replicas.
        """
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(f"data_parallel_backend must be one of {DATA_PARALLEL_BACKENDS}, "
                             f"got {data_parallel_backend!r}")
        router = make_router(routing_policy, engine_args.get("block_size", 16))
        launchers: list[Any] = [engine_args.pop("multiprocess_mode", False)] * data_parallel_size
        placement = None
        if core_launchers is not None:
            if len(core_launchers) != data_parallel_size:
                raise ValueError(f"{len(core_launchers)} core launchers for "
                                 f"{data_parallel_size} replicas")
            launchers = list(core_launchers)
        elif data_parallel_backend == "ray":
            from pagedllm.engine.core_ray import RayReplicaPlacement

            placement = RayReplicaPlacement(
                data_parallel_size, engine_args.get("tensor_parallel_size", 1)
                * engine_args.get("pipeline_parallel_size", 1), data_parallel_address)
            launchers = [placement.launcher(i) for i in range(data_parallel_size)]

        def build(i: int) -> AsyncLLM:
            # Cores in processes of this machine (multiprocess mode, the API-server pool's)
            # share its cores out among them; in-process replicas share this process's thread
            # pool, and Ray places its actors itself.
            local = ({"data_parallel_size_local": data_parallel_size,
                      "data_parallel_rank_local": i} if launchers[i] and placement is None
                     else {})
            return AsyncLLM.from_engine_args(model, stat_loggers=stat_loggers(i),
                                             multiprocess_mode=launchers[i], **local,
                                             **engine_args)

        if not launchers[0]:
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
                if placement is not None:
                    placement.shutdown()
                raise f.exception()
        return cls(replicas, router, placement.shutdown if placement is not None else None)

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
        if self._on_shutdown is not None:
            on_shutdown, self._on_shutdown = self._on_shutdown, None
            on_shutdown()
