"""AsyncLLM: the `LLMEngine` behind an asyncio interface, for the OpenAI server.

One background thread owns the engine and is the only thread that touches it: it takes commands
(add, abort, reset, shutdown) from a thread-safe queue, runs `step()` while requests are unfinished,
and hands each step's outputs to the event loop, where every request has its own asyncio.Queue.

NOTE(async_llm): a thread is enough for now because the heavy work of a step (the model forward,
sampling) is torch ops that release the GIL, so the event loop keeps serving HTTP while the engine
computes. Moving the engine core into its own process (vLLM V1's EngineCoreClient over ZMQ) is
future work; the command/output boundary here is the same one that split would cut along.

Failure rules: a ValueError from `add_request` fails that request only; any exception in the engine
loop marks the engine dead (`EngineDeadError`) and fails every pending and future request at once,
so no caller ever waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception, or shutdown); no request can be served any more."""


@dataclass
class FinishedRequestStats:
    """One request that left the engine (finished or aborted)."""

    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float  # arrival (generate() called) -> last output, seconds


@dataclass
class IterationStats:
    """What happened in one engine-loop iteration (deltas, not totals)."""

    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found


class StatLogger(Protocol):
    """Receives the engine's state after each loop iteration (called on the engine thread)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        ...


@dataclass
class _RequestTimes:
    arrival_time: float  # time.monotonic() when generate() was called
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    future: concurrent.futures.Future


@dataclass
class _AbortCommand:
    request_ids: list[str]


@dataclass
class _CallCommand:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


_SHUTDOWN = object()


class AsyncLLM:
    """Serve many concurrent asyncio callers from one engine thread.

    Args:
        engine: the engine; after `start()` only the engine thread may use it.
        stat_loggers: called on the engine thread after every iteration that did something.
    """

    def __init__(self, engine: LLMEngine, stat_loggers: Sequence[StatLogger] = ()) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.config.max_model_len
        self.vocab_size: int = engine.input_processor.vocab_size
        self.stat_loggers = list(stat_loggers)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._command_lock = threading.Lock()  # orders "put a command" against "mark dead"
        self._dead: EngineDeadError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor_shut_down = False
        # Loop-thread state: request id -> queue of RequestOutput | BaseException.
        self._streams: dict[str, asyncio.Queue] = {}
        # Engine-thread state.
        self._times: dict[str, _RequestTimes] = {}
        self._last_preemptions = 0
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0

    @classmethod
    def from_engine_args(cls, model: str, stat_loggers: Sequence[StatLogger] = (),
                         **engine_args: Any) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(model, **engine_args), stat_loggers)

    # ---------------------------------------------------------------- event-loop side

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def start(self) -> None:
        """Start the engine thread, bound to the running event loop (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_engine_loop, name="pagedllm-engine",
                                        daemon=True)
        self._thread.start()

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs until it finishes.

        Outputs may be coalesced when the consumer is slower than the engine (each one is
        cumulative, so only the latest matters); the last one yielded has `finished=True`.
        Closing or cancelling the iterator before that aborts the request, freeing its KV blocks.

        Raises:
            ValueError: the request is invalid (other requests are unaffected), or the id is in use.
            EngineDeadError: the engine loop failed or was shut down.
        """
        self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._put(_AddCommand(request_id, prompt, sampling_params, time.monotonic(), future))
            await asyncio.wrap_future(future)
            while not finished:
                item = await stream.get()
                while not isinstance(item, BaseException) and not item.finished \
                        and not stream.empty():
                    item = stream.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); non-blocking, thread-safe."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        try:
            self._put(_AbortCommand(ids))
        except EngineDeadError:
            pass

    async def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry; returns how many blocks were uncached."""
        self.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_CallCommand(self._reset_prefix_cache, future))
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread (after its current step), fail what is pending, free the executor.

        Safe to call from any thread, more than once. Blocks up to `timeout_s` for the thread.
        """
        with self._command_lock:
            if self._dead is None:
                self._commands.put(_SHUTDOWN)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout_s)
                return
        self._mark_dead(EngineDeadError("the engine was shut down"))
        if not self._executor_shut_down:
            self._executor_shut_down = True
            self.engine.engine_core.shutdown()

    def _put(self, command: Any) -> None:
        with self._command_lock:
            if self._dead is not None:
                raise self._dead
            self._commands.put(command)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---------------------------------------------------------------- engine-thread side

    def _run_engine_loop(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                did_work = self._process_commands(block=not busy)
                if did_work is None:
                    return
                iteration = IterationStats()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._update_times(outputs, iteration)
                    if outputs:
                        self._call_in_loop(self._deliver, outputs)
                    did_work = True
                if did_work:
                    self._record(iteration)
        except BaseException as e:  # noqa: BLE001 - any failure must fail every request
            logger.exception("the engine loop failed; failing all pending requests")
            dead = EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}")
            dead.__cause__ = e
            self._mark_dead(dead)

    def _process_commands(self, block: bool) -> bool | None:
        """Run queued commands (waiting for one if `block`); None means shut down."""
        did_work = False
        aborted = IterationStats()
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                break
            block = False
            if command is _SHUTDOWN:
                return None
            did_work = True
            if isinstance(command, _AddCommand):
                self._add(command)
            elif isinstance(command, _AbortCommand):
                self._abort(command.request_ids, aborted)
            else:
                try:
                    command.future.set_result(command.fn())
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    command.future.set_exception(e)
        if aborted.finished_requests:
            self._record(aborted)
        return did_work

    def _add(self, command: _AddCommand) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except Exception as e:  # noqa: BLE001 - an invalid request fails only itself
            command.future.set_exception(e)
            return
        self._times[command.request_id] = _RequestTimes(command.arrival_time)
        command.future.set_result(None)

    def _abort(self, request_ids: list[str], iteration: IterationStats) -> None:
        live = [req_id for req_id in request_ids if req_id in self._times]
        if not live:
            return
        self.engine.abort_request(live)
        now = time.monotonic()
        for req_id in live:
            times = self._times.pop(req_id)
            iteration.finished_requests.append(FinishedRequestStats(
                "abort", times.num_prompt_tokens, times.num_generation_tokens,
                now - times.arrival_time))

    def _reset_prefix_cache(self) -> int:
        self._record(IterationStats())  # count lookups made before the counters restart at 0
        num_blocks = self.engine.reset_prefix_cache()
        self._last_prefix_queries = self._last_prefix_hits = 0
        return num_blocks

    def _update_times(self, outputs: list[RequestOutput], iteration: IterationStats) -> None:
        now = time.monotonic()
        for out in outputs:
            times = self._times.get(out.request_id)
            if times is None:
                continue
            num_new = sum(len(c.token_ids) for c in out.outputs) - times.num_generation_tokens
            if num_new > 0:
                if times.first_token_time is None:
                    times.first_token_time = now
                    times.num_prompt_tokens = len(out.prompt_token_ids)
                    iteration.num_prompt_tokens += times.num_prompt_tokens
                    iteration.time_to_first_tokens_s.append(now - times.arrival_time)
                else:
                    iteration.inter_token_latencies_s.append(now - times.last_token_time)
                times.last_token_time = now
                times.num_generation_tokens += num_new
                iteration.num_generation_tokens += num_new
            if out.finished:
                del self._times[out.request_id]
                iteration.finished_requests.append(FinishedRequestStats(
                    out.outputs[0].finish_reason or "stop", times.num_prompt_tokens,
                    times.num_generation_tokens, now - times.arrival_time))

    def _record(self, iteration: IterationStats) -> None:
        stats = self.engine.get_stats()
        prefix = stats.prefix_cache_stats
        iteration.num_preemptions = max(0, stats.num_preemptions - self._last_preemptions)
        iteration.prefix_cache_queries = max(0, prefix.queries - self._last_prefix_queries)
        iteration.prefix_cache_hits = max(0, prefix.hits - self._last_prefix_hits)
        self._last_preemptions = stats.num_preemptions
        self._last_prefix_queries, self._last_prefix_hits = prefix.queries, prefix.hits
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats, iteration)

    def _mark_dead(self, error: EngineDeadError) -> None:
        """Refuse new commands, fail queued ones, and fail every open stream."""
        with self._command_lock:
            if self._dead is None:
                self._dead = error
            error = self._dead
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, (_AddCommand, _CallCommand)):
                    command.future.set_exception(error)
        self._call_in_loop(self._fail_streams, error)
