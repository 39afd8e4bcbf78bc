"""AsyncLLM: the `LLMEngine` behind an asyncio interface, for the OpenAI server.

One background thread owns the engine and is the only thread that touches it: it takes commands
(add, abort, reset, shutdown) from a thread-safe queue, runs `step()` while requests are unfinished,
and hands each step's outputs to the event loop, where every request has its own asyncio.Queue.

NOTE(async_llm): in-process (the default), the thread runs the whole engine: the heavy work of a
step (the model forward, sampling) is torch ops that release the GIL, so the event loop keeps
serving HTTP while the engine computes. With `multiprocess_mode=True` the engine core (scheduler,
executor, KV cache) runs in its own process (engine/core_client.py, vLLM V1's EngineCoreClient
over ZeroMQ) and this thread only sends requests and turns the core's token deltas into outputs
(detokenization, stop strings); a core process that dies fails every request at once.

Admission: `add_request` validates the request completely on the caller's side (the
`InputProcessor`: tokenization, every range and vocabulary check, grammar parsing) and returns only
once the engine thread has queued it, so a server can answer a bad request with a 4xx before it
sends any byte of a response. It returns a `RequestStream`; closing the stream (or cancelling the
caller at any moment, even while `add_request` itself is waiting) aborts the request and frees its
KV blocks.

Failure rules: a ValueError from admission fails that request only; a failure that belongs to one
request inside a step (its logits processor, its grammar, its detokenization) ends that request
with finish_reason "error" and `RequestFailedError` on its stream; any other exception in the
engine loop marks the engine dead (`EngineDeadError`), fails every pending and future request at
once (so no caller ever waits forever) and calls the `on_dead` callbacks (the server exits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.engine_core import EngineCoreRequest
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.iteration_stats import FinishedRequestStats, IterationStats, StatLogger
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.platforms import current_platform
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """Something that belongs to this request alone failed inside a step (its logits processor,
    grammar or detokenization); the engine and the other requests go on. `output` is the
    request's last RequestOutput (finish_reason "error" on the failed sequence)."""

    def __init__(self, message: str, output: RequestOutput) -> None:
        super().__init__(message)
        self.output = output


class RequestStream:
    """The outputs of one admitted request, as an async iterator of cumulative RequestOutputs.

    Outputs may be coalesced when the consumer is slower than the engine: a cumulative output
    replaces the ones before it, DELTA outputs (`delta`) are concatenated
    (`RequestOutput.add_delta`), so no token is lost; the last one yielded has `finished=True`. Closing
    the stream (`close()`, idempotent) before that aborts the request. Iterating raises
    `RequestFailedError` if the request failed alone, `EngineDeadError` if the engine died.

    Args:
        request_id: the request's id.
        queue: where the engine's outputs (or an exception) arrive, on the event loop.
        on_close: called once with `(request_id, finished)` when the stream closes.
        delta: the request's outputs are RequestOutputKind.DELTA.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue,
                 on_close: Callable[[str, bool], None], delta: bool = False) -> None:
        self.request_id = request_id
        self._delta = delta
        self._queue = queue
        self._on_close: list[Callable[[str, bool], None]] | None = [on_close]
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            self.close()
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
            while not isinstance(item, BaseException) and not item.finished \
                    and not self._queue.empty():
                later = self._queue.get_nowait()
                item = (item.add_delta(later) if self._delta
                        and not isinstance(later, BaseException) else later)
        except BaseException:
            self.close()  # cancelled while waiting: abort
            raise
        if isinstance(item, BaseException):
            self.finished = True  # nothing left to abort
            self.close()
            raise item
        if item.finished:
            self.finished = True
            error = item.error
            if error is not None:
                self.close()
                raise RequestFailedError(error, item)
        return item

    def close(self) -> None:
        """Stop listening; aborts the request unless it already finished."""
        if self._on_close is not None:
            callbacks, self._on_close = self._on_close, None
            for callback in reversed(callbacks):
                callback(self.request_id, self.finished)

    def add_close_callback(self, callback: Callable[[str, bool], None]) -> None:
        """Also call `callback(request_id, finished)` when the stream closes (first)."""
        if self._on_close is None:
            callback(self.request_id, self.finished)
        else:
            self._on_close.append(callback)

    async def aclose(self) -> None:
        self.close()


@dataclass
class _RequestTimes:
    arrival_time: float  # time.monotonic() when generate() was called
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _AddCommand:
    request: EngineCoreRequest
    prompt_text: str | None
    arrival_time: float
    future: concurrent.futures.Future


@dataclass
class _AbortCommand:
    request_ids: list[str]


@dataclass
class _CallCommand:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


@dataclass
class _PauseCommand:
    mode: str   # "abort" | "wait" | "keep" (AsyncLLM.pause_generation)
    future: concurrent.futures.Future


PAUSE_MODES = ("abort", "wait", "keep")

_SHUTDOWN = object()
# Seconds between liveness checks of the engine core while the engine thread waits idle.
_HEALTH_CHECK_S = 0.5


class AsyncLLM:
    """Serve many concurrent asyncio callers from one engine thread.

    Args:
        engine: the engine; after `start()` only the engine thread may use it.
        stat_loggers: called on the engine thread after every iteration that did something.
    """

    def __init__(self, engine: LLMEngine, stat_loggers: Sequence[StatLogger] = ()) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.config.max_model_len
        self.vocab_size: int = engine.input_processor.vocab_size
        self.default_sampling_params = engine.config.default_sampling_params
        self.stat_loggers = list(stat_loggers)
        for stat_logger in self.stat_loggers:   # (an optional part of the StatLogger protocol)
            if hasattr(stat_logger, "record_engine_info"):
                stat_logger.record_engine_info(engine.engine_core.kv_cache_bytes_per_token)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._command_lock = threading.Lock()  # orders "put a command" against "mark dead"
        self._dead: EngineDeadError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor_shut_down = False
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        # Loop-thread state: request id -> queue of RequestOutput | BaseException.
        self._streams: dict[str, asyncio.Queue] = {}
        # Engine-thread state.
        self._times: dict[str, _RequestTimes] = {}
        self._last_preemptions = 0
        self._last_spec_decoding = SpecDecodingStats()
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._last_eplb_rebalances = 0
        # Pause of generation (engine thread): no step while paused; adds are held until resume.
        self._paused = False
        self._held_adds: list[_AddCommand] = []
        self._drain_waiters: list[concurrent.futures.Future] = []   # pauses in mode "wait"

    @classmethod
    def from_engine_args(cls, model: str, stat_loggers: Sequence[StatLogger] = (),
                         **engine_args: Any) -> AsyncLLM:
        """Build the engine from flat engine arguments (as `LLMEngine.from_engine_args`).

        `num_scheduler_steps` defaults to 1 here: a server streams every token as it comes and
        admits new requests at every step (offline generation defaults to multi-step rounds on
        CPU; see `resolve_num_scheduler_steps`).
        """
        if engine_args.get("num_scheduler_steps") is None:
            engine_args["num_scheduler_steps"] = 1
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
        # The engine thread keeps the kernels' cores it started with; this (event-loop) thread
        # and those it starts later move to the cores kept for the front end, if any.
        current_platform.bind_front_end(self.engine.config.parallel_config.cpu_reserved_cores)

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams,
                          lora_request: LoRARequest | None = None,
                          priority: int = 0) -> RequestStream:
        """Validate a request completely, queue it (under `lora_request`'s adapter, if given;
        `priority`: lower first under the priority scheduling policy, must be 0 under fcfs),
        and return its output stream.

        Returns once the engine thread has queued the request. Cancelling the caller at any
        point aborts the request if it was queued.

        Raises:
            ValueError: the request is invalid (the message starts with the offending field's
                name where there is one), or the id is in use; nothing was queued.
            EngineDeadError: the engine loop failed or was shut down.
        """
        self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._dead is not None:
            raise self._dead
        lora_request = self.check_lora_request(lora_request)
        core_request, prompt_text = self.input_processor.process(request_id, prompt,
                                                                 sampling_params, priority)
        core_request.lora_request = lora_request
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        stream = RequestStream(request_id, queue, self._close_stream,
                               sampling_params.output_kind == RequestOutputKind.DELTA)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._put(_AddCommand(core_request, prompt_text, time.monotonic(), future))
            await asyncio.wrap_future(future)
        except BaseException as e:
            # Refused (nothing to abort) or cancelled (abort: the add may have happened).
            stream.finished = not isinstance(e, asyncio.CancelledError)
            stream.close()
            raise
        return stream

    def check_lora_request(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The engine's LoRA admission check (`LoRAAdmission.check`: ValueError naming the
        problem); returns `lora_request`."""
        return self.engine.lora_admission.check(lora_request)

    def forget_lora(self, lora_int_id: int) -> None:
        """Drop an unloaded adapter's id binding (`LoRAAdmission.forget`)."""
        self.engine.lora_admission.forget(lora_int_id)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """`add_request`, then yield its outputs until it finishes (see `RequestStream`).

        Closing or cancelling the iterator before the end aborts the request, freeing its KV
        blocks.

        Raises:
            ValueError: the request is invalid (other requests are unaffected), or the id is in use.
            RequestFailedError: the request failed alone inside a step.
            EngineDeadError: the engine loop failed or was shut down.
        """
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` on the event loop if the engine loop fails (not on shutdown)."""
        self._dead_callbacks.append(callback)

    def _close_stream(self, request_id: str, finished: bool) -> None:
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

    # ------------------------------------ pause, sleep mode, weight updates (docs/sleep_mode.md)
    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between steps; its result (or exception)."""
        self.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_CallCommand(fn, future))
        return await asyncio.wrap_future(future)

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop stepping (vLLM's `pause_generation`). `mode`: "abort" finishes the unfinished
        requests now (finish_reason "abort"), "wait" lets them finish first (returns then),
        "keep" freezes them where they are (they go on after `resume_generation`). While
        paused, new requests are queued: their `add_request` returns after the resume.

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_PauseCommand(mode, future))
        await asyncio.wrap_future(future)

    async def resume_generation(self) -> None:
        """Step again, and queue the requests held while paused (a no-op when not paused)."""
        await self._call(self._resume)

    async def is_paused(self) -> bool:
        return await self._call(lambda: self._paused)

    async def sleep(self, level: int = 1) -> None:
        """`EngineCore.sleep` (needs an idle engine: pause with mode "abort" or "wait"
        first, or let the requests finish)."""
        await self._call(lambda: self._reset_counters_after(lambda: self.engine.sleep(level)))

    async def wake_up(self) -> None:
        await self._call(self.engine.wake_up)

    async def is_sleeping(self) -> bool:
        return await self._call(self.engine.is_sleeping)

    async def update_weights(self, model_path: str) -> None:
        """`EngineCore.update_weights` (needs an idle engine, as `sleep`)."""
        await self._call(lambda: self._reset_counters_after(
            lambda: self.engine.update_weights(model_path)))

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return await self._call(lambda: self.engine.collective_rpc(method, args))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread (after its current step), fail what is pending, free the executor.

        Safe to call from any thread, more than once. Blocks up to `timeout_s` for the thread.
        """
        with self._command_lock:
            if self._dead is None:
                self._commands.put(_SHUTDOWN)
                self.engine.wake()
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
            self.engine.wake()  # a step waiting for a core process's outputs takes it now

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
                busy = self.engine.has_unfinished_requests() and not self._paused
                did_work = self._process_commands(block=not busy)
                if did_work is None:
                    return
                iteration = IterationStats()
                if not self._paused and self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._update_times(outputs, iteration)
                    if outputs:
                        self._call_in_loop(self._deliver, outputs)
                    did_work = True
                if self._drain_waiters and not self.engine.has_unfinished_requests():
                    self._paused = True
                    for waiter in self._drain_waiters:
                        waiter.set_result(None)
                    self._drain_waiters = []
                if did_work:
                    self._record(iteration)
        except BaseException as e:  # noqa: BLE001 - any failure must fail every request
            logger.exception("the engine loop failed; failing all pending requests")
            dead = EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}")
            dead.__cause__ = e
            self._mark_dead(dead, failed=True)

    def _process_commands(self, block: bool) -> bool | None:
        """Run queued commands (waiting for one if `block`); None means shut down."""
        did_work = False
        aborted = IterationStats()
        while True:
            try:
                command = self._commands.get(block=block,
                                             timeout=_HEALTH_CHECK_S if block else None)
            except queue.Empty:
                if not block:
                    break
                # Idle: a dead engine-core process must fail /health without a request.
                self.engine.check_health()
                continue
            block = False
            if command is _SHUTDOWN:
                return None
            did_work = True
            if isinstance(command, _AddCommand):
                if self._paused or self._drain_waiters:
                    self._held_adds.append(command)
                else:
                    self._add(command)
            elif isinstance(command, _PauseCommand):
                self._pause(command, aborted)
            elif isinstance(command, _AbortCommand):
                self._abort(command.request_ids, aborted)
            elif command.future.set_running_or_notify_cancel():  # else: the caller gave up
                try:
                    command.future.set_result(command.fn())
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    command.future.set_exception(e)
        if aborted.finished_requests:
            self._record(aborted)
        return did_work

    def _add(self, command: _AddCommand) -> None:
        # A caller cancelled before its request was reached never gets it queued. After this
        # call the future can no longer be cancelled: a caller cancelled from now on aborts.
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            self.engine.add_processed_request(command.request, command.prompt_text)
        except Exception as e:  # noqa: BLE001 - an invalid request fails only itself
            command.future.set_exception(e)
            return
        self._times[command.request.request_id] = _RequestTimes(command.arrival_time)
        command.future.set_result(None)

    def _pause(self, command: _PauseCommand, iteration: IterationStats) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        if command.mode == "wait" and self.engine.has_unfinished_requests():
            self._drain_waiters.append(command.future)   # answered once they finished
            return
        if command.mode == "abort" and self._times:
            outputs = self.engine.abort_with_outputs(list(self._times))
            self._update_times(outputs, iteration)
            if outputs:
                self._call_in_loop(self._deliver, outputs)
        self._paused = True
        command.future.set_result(None)

    def _resume(self) -> None:
        self._paused = False
        for waiter in self._drain_waiters:   # a resume ends a pause still draining
            waiter.set_result(None)
        self._drain_waiters = []
        held, self._held_adds = self._held_adds, []
        for command in held:
            self._add(command)

    def _reset_counters_after(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, which may reset the prefix cache (and its counters): the lookups made before
        are recorded first, and the counters' baseline follows: the engine's stats right after
        the call (restarted at 0; an engine core in its own process sends them before the call
        returns; with several front ends this front end's share, which a reset leaves as it is:
        engine/core_stat_shares.py)."""
        self._record(IterationStats())
        result = fn()
        stats = self.engine.get_stats().prefix_cache_stats
        self._last_prefix_queries, self._last_prefix_hits = stats.queries, stats.hits
        return result

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
        return self._reset_counters_after(self.engine.reset_prefix_cache)

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
        iteration.spec_decoding_stats = stats.spec_decoding_stats.minus(self._last_spec_decoding)
        self._last_spec_decoding = stats.spec_decoding_stats
        self._last_prefix_queries, self._last_prefix_hits = prefix.queries, prefix.hits
        eplb = self.engine.get_eplb_stats()
        if eplb is not None and eplb.num_rebalances != self._last_eplb_rebalances:
            iteration.num_eplb_rebalances = max(0, eplb.num_rebalances - self._last_eplb_rebalances)
            iteration.eplb_stats = eplb
            self._last_eplb_rebalances = eplb.num_rebalances
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats, iteration)

    def _mark_dead(self, error: EngineDeadError, failed: bool = False) -> None:
        """Refuse new commands, fail queued ones, and fail every open stream; when the engine
        `failed` (not a shutdown), also call the on_dead callbacks (once)."""
        with self._command_lock:
            first = self._dead is None
            if first:
                self._dead = error
            error = self._dead
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, (_AddCommand, _CallCommand, _PauseCommand)) \
                        and command.future.set_running_or_notify_cancel():
                    command.future.set_exception(error)
            for pending in self._held_adds:
                if pending.future.set_running_or_notify_cancel():
                    pending.future.set_exception(error)
            self._held_adds = []
            for waiter in self._drain_waiters:
                waiter.set_exception(error)
            self._drain_waiters = []
        self._call_in_loop(self._fail_streams, error)
        if first and failed:
            for callback in self._dead_callbacks:
                self._call_in_loop(callback, error)
