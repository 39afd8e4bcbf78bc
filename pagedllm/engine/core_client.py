"""The front end's handle on the engine core: in this process, or in its own (vLLM V1's
EngineCoreClient with `multiprocess_mode`).

`make_engine_core_client(config, multiprocess_mode)` returns
- `multiprocess_mode=False`: the `EngineCore` itself (vLLM's InprocClient; today's behaviour and
  the default of `LLM` and the server);
- `multiprocess_mode=True`: an `MPEngineCoreClient`, with the same methods, whose core runs in a
  spawned process (core_proc.py) behind two ZeroMQ IPC sockets, so tokenization,
  detokenization, HTTP and JSON in the front end no longer compete with scheduling for one GIL;
- `multiprocess_mode=<a CoreLauncher>`: the same client, its core started by that launcher, e.g.
  as a Ray actor on any node of a cluster (core_ray.py, `--data-parallel-backend ray`): then the
  sockets are TCP, bound to the launcher's `bind_host` only and protected by CURVE.

Any public method of `EngineCore` is reachable through the client as a *utility call*
(`client.reset_prefix_cache()` is `client.call_utility("reset_prefix_cache")`): a method added to
the engine core needs no transport code, provided its arguments and result are plain data or the
engine's plain dataclasses (core_serial.py converts them by the method's annotations).

Liveness: the client watches the core's process sentinel together with the output socket, so
`step()` and utility calls raise `EngineDeadError` within a poll interval of the process dying
(SIGKILL included); `check_health()` asks the same of an idle front end.
`step()` blocks until outputs arrive (no polling loop); `wake()` lets another thread (AsyncLLM's
event loop, with a new request) end that wait.
"""

from __future__ import annotations

import builtins
import functools
import itertools
import logging
import multiprocessing as mp
import os
import select
import shutil
import tempfile
import time
import typing
import weakref
from typing import Any, Protocol

import msgspec
import zmq
import zmq.auth.thread

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput, EplbStats
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine import core_serial as wire
from pagedllm.engine.core_proc import CoreEndpoints, run_engine_core
from pagedllm.engine.engine_core import EngineCore, EngineCoreRequest
from pagedllm.engine.sleep_mode import EngineSleepingError
from pagedllm.executor.multiproc import check_main_reimportable

logger = logging.getLogger(__name__)

# Milliseconds `step()` waits for the core's next outputs before it returns none; `wake()`
# (a new command for the caller's loop) ends the wait at once.
_STEP_POLL_MS = 1000
# Seconds the core process gets to load the model and report Ready.
_START_TIMEOUT_S = 600.0
# Seconds the core process gets to exit after Shutdown before it is terminated, then killed.
_SHUTDOWN_GRACE_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception, shutdown, or its process died); no request can be
    served any more."""


class CoreHandle(Protocol):
    """A started engine core, as the client watches and stops it (the subset of
    `multiprocessing.Process` it uses)."""

    pid: int | None
    sentinel: int       # a file descriptor that becomes readable when the core has ended
    exitcode: int | None

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class CoreLauncher(Protocol):
    """Starts an engine core that connects to a client's sockets.

    `bind_host` None: the core runs on this machine and the client binds IPC sockets in a
    private folder; else the client binds TCP sockets on that address only (an address of this
    machine the core's node can reach) with CURVE encryption and authentication.
    `fixed_endpoints`: IPC endpoints chosen by whoever started a shared core (the client binds
    them instead of its own). `shared`: the core serves other front ends too: the client
    never stops it (whoever started it does)."""

    bind_host: str | None
    fixed_endpoints: CoreEndpoints | None
    shared: bool

    def launch(self, config: EngineConfig, endpoints: CoreEndpoints,
               parent_pid: int) -> CoreHandle: ...


class SpawnLauncher:
    """The core in a process spawned on this machine (`multiprocess_mode=True`)."""

    bind_host = None
    fixed_endpoints = None
    shared = False

    def launch(self, config: EngineConfig, endpoints: CoreEndpoints,
               parent_pid: int) -> CoreHandle:
        check_main_reimportable("spawn")
        proc = mp.get_context("spawn").Process(target=run_engine_core,
                                               name="pagedllm-engine-core",
                                               args=(config, endpoints, parent_pid))
        proc.start()
        return proc


class AttachLauncher:
    """An engine-core process started by someone else (the API-server pool,
    entrypoints/openai/api_server_pool.py) that serves several front ends; this client binds
    `endpoints` (IPC, in the pool's private folder) and watches process `pid`.

    Raises (launch): OSError if process `pid` does not exist.
    """

    bind_host = None
    shared = True

    def __init__(self, endpoints: CoreEndpoints, pid: int) -> None:
        self.fixed_endpoints = endpoints
        self.pid = pid

    def launch(self, config: EngineConfig, endpoints: CoreEndpoints,
               parent_pid: int) -> CoreHandle:
        return PidHandle(self.pid)


class PidHandle:
    """A process of this machine that is not our child, as a `CoreHandle`: its pidfd is the
    sentinel (Linux >= 5.3); stopping it is its parent's business."""

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)
        weakref.finalize(self, os.close, self.sentinel)

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


def make_engine_core_client(config: EngineConfig,
                            multiprocess_mode: bool | CoreLauncher = False):
    """The engine core for a front end: `EngineCore(config)` in this process, or an
    `MPEngineCoreClient(config)` serving it from its own process, started by
    `multiprocess_mode` when that is a `CoreLauncher` (see the module docstring).

    Raises:
        whatever building the core raises (in multiprocess mode: the core's start-up error as
        the same builtin exception type, else RuntimeError, with its message; EngineDeadError
        if its process died while starting).
    """
    if not multiprocess_mode:
        return EngineCore(config)
    launcher = None if multiprocess_mode is True else multiprocess_mode
    return MPEngineCoreClient(config, launcher=launcher)


class MPEngineCoreClient:
    """`EngineCore`'s interface, served by a core in its own process (single-threaded use: one
    thread at a time calls it, as `LLMEngine` and `AsyncLLM`'s engine thread do).

    Args:
        config: validated engine config (sent to the child at spawn).
        start_timeout_s: how long the core may take to report Ready.
        launcher: starts the core (default: `SpawnLauncher`, a process on this machine).

    Attributes:
        num_blocks, kv_cache_capacity, kv_cache_bytes_per_token: as `EngineCore`'s (reported
            by the core at start).
        eplb_stats: the last EPLB rebalance the core reported (None: none yet).
        pid: the core process's id.
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = _START_TIMEOUT_S,
                 launcher: CoreLauncher | None = None) -> None:
        self.config = config
        self._sleep_level = 0   # mirrored from the sleep / wake_up calls made through us
        launcher = launcher or SpawnLauncher()
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")  # mode 0700: this user only
        self._zmq = zmq.Context()
        self._inputs = self._zmq.socket(zmq.PUSH)
        self._outputs = self._zmq.socket(zmq.PULL)
        for sock in (self._inputs, self._outputs):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._auth = None
        self._encoder = wire.make_encoder()
        self._decoder = wire.make_output_decoder()
        # `wake()` writes a byte here to end a `step()` that waits for outputs.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        try:
            if launcher.bind_host is None:
                endpoints = launcher.fixed_endpoints or CoreEndpoints(
                    f"ipc://{self._dir}/input", f"ipc://{self._dir}/output")
                self.input_address = endpoints.input_address
                self.output_address = endpoints.output_address
                self._inputs.bind(self.input_address)
                self._outputs.bind(self.output_address)
            else:
                endpoints = self._bind_tcp(launcher.bind_host)
            self._proc = launcher.launch(config, endpoints, os.getpid())
        except BaseException:
            _release(None, self._inputs, b"", self._zmq, self._auth, self._dir,
                     (self._wake_r, self._wake_w))
            raise
        self.pid = self._proc.pid
        self._finalizer = weakref.finalize(self, _release,
                                           None if launcher.shared else self._proc, self._inputs,
                                           self._encoder.encode(wire.Shutdown()), self._zmq,
                                           self._auth, self._dir, (self._wake_r, self._wake_w))
        self._poller = zmq.Poller()
        self._poller.register(self._outputs, zmq.POLLIN)
        self._poller.register(self._proc.sentinel, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._dead: EngineDeadError | None = None
        self._unfinished: set[str] = set()
        # Aborts sent that no StepOutputs has acknowledged yet (each carries the stats after
        # the aborts it counts): the caller's loop keeps stepping until all are, so its gauges
        # never keep aborted requests (a disconnected stream left num_requests_running at 1).
        self._unacked_aborts = 0
        self._pending: list[EngineCoreOutput] = []
        self._results: dict[int, wire.UtilityResult] = {}
        self._call_ids = itertools.count()
        self._ready: wire.Ready | None = None
        self._failure: str | None = None  # the core's EngineFailed message, if any
        self._stats: SchedulerStats | None = None
        self.eplb_stats: EplbStats | None = None
        try:
            self._wait_ready(start_timeout_s)
        except EngineDeadError as e:
            self.shutdown()
            if self._failure is None:
                raise
            # The core's start-up error, as the in-process engine would raise it.
            raise _rebuild_error(self._failure) from e
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = self._ready.num_blocks
        self.kv_cache_capacity = self._ready.kv_cache_capacity
        self.kv_cache_bytes_per_token = self._ready.kv_cache_bytes_per_token
        # The core answers every utility call with its stats first (this front end's view of
        # them when the core serves several: engine/core_stat_shares.py); they set _stats.
        self.call_utility("get_stats")

    def _bind_tcp(self, host: str) -> CoreEndpoints:
        """Bind both sockets on `host` (free ports) as CURVE servers that accept only a key
        pair made here for the core; the core receives it with its endpoints."""
        server_public, server_secret = zmq.curve_keypair()
        core_public, core_secret = zmq.curve_keypair()
        self._auth = zmq.auth.thread.ThreadAuthenticator(self._zmq)
        self._auth.start()
        self._auth.configure_curve_callback("*", _OnlyKey(core_public))
        where = f"[{host}]" if ":" in host else host
        addresses = []
        for sock in (self._inputs, self._outputs):
            sock.ipv6 = ":" in host
            sock.curve_server = True
            sock.curve_secretkey = server_secret
            port = sock.bind_to_random_port(f"tcp://{where}")
            addresses.append(f"tcp://{where}:{port}")
        self.input_address, self.output_address = addresses
        return CoreEndpoints(self.input_address, self.output_address, server_public,
                             core_public, core_secret)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._ready is None:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the engine-core process did not start within "
                                   f"{timeout_s:.0f} s")
            self._receive(1000)

    # ------------------------------------------------------------ EngineCore's interface

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request in the core (fire and forget: a refusal by the core's own guard
        comes back as an "error" output of that request).

        Raises:
            ValueError: the request cannot cross processes (logits processors).
            EngineDeadError: the core is dead.
            EngineSleepingError: the core is asleep (known here: sleep and wake-up go through
                this client), so the request is refused before it is sent.
        """
        self.check_awake()
        self._send(wire.request_to_wire(req))
        self._unfinished.add(req.request_id)

    # Sleep state mirrored on this side: every request checks it (engine/sleep_mode.py).
    def sleep(self, level: int = 1) -> None:
        self.call_utility("sleep", level)
        self._sleep_level = max(self._sleep_level, level)

    def wake_up(self) -> None:
        self.call_utility("wake_up")
        self._sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self._sleep_level)

    def check_awake(self) -> None:
        """Raises EngineSleepingError while the core sleeps (no round trip)."""
        if self._sleep_level:
            raise EngineSleepingError(f"the engine is asleep (sleep level {self._sleep_level}); "
                                      "it serves requests again after wake_up")

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._dead is not None:
            return
        self._unfinished.difference_update(request_ids)
        self._send(wire.AbortRequests(list(request_ids)))
        self._unacked_aborts += 1

    def wake(self) -> None:
        """End a `step()` waiting in another thread for outputs (it returns what it has, maybe
        nothing): the caller's loop has a new command. Thread-safe."""
        if not self._finalizer.alive:  # the pipe is closed (its fd may be reused)
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # already woken: the pipe is full
            pass

    def step(self) -> list[EngineCoreOutput]:
        """The outputs the core sent since the last call; when none are there, waits for some
        up to a second or until `wake()` (may return [] while requests are unfinished).

        Raises:
            EngineDeadError: the core failed or its process died.
        """
        if not self._pending:
            self._receive(_STEP_POLL_MS)
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        """True while requests are unfinished, outputs undelivered, or an abort unacknowledged
        (the core acknowledges with its next step's outputs, or alone once it is idle)."""
        return bool(self._unfinished) or bool(self._pending) or self._unacked_aborts > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def get_stats(self) -> SchedulerStats:
        """The scheduler's stats as of the core's last step (sent with its outputs) or utility
        call (sent before its result); when the core serves several front ends, the counters
        are this front end's share (engine/core_stat_shares.py)."""
        return self._stats

    def check_health(self) -> None:
        """Raises EngineDeadError if the core failed or its process died."""
        if self._dead is None:
            self._receive(0)
        if self._dead is not None:
            raise self._dead

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call `EngineCore.<method>(*args)` in the core process and return its result
        (converted to the method's annotated return type).

        Raises:
            the method's own exception type when it is a builtin one (ValueError, ...), else
            RuntimeError, with the core's message; EngineDeadError if the core is dead.
        """
        call_id = next(self._call_ids)
        self._send(wire.CallUtility(call_id, method, list(args)))
        while call_id not in self._results:
            self._receive(1000)
        result = self._results.pop(call_id)
        if result.error is not None:
            raise _rebuild_error(result.error)
        return _convert_result(method, result.result)

    def __getattr__(self, name: str) -> Any:
        # Public methods of EngineCore that the client does not define itself: utility calls.
        if not name.startswith("_") and callable(getattr(EngineCore, name, None)):
            return functools.partial(self.call_utility, name)
        raise AttributeError(f"{name!r} is not available with the engine core in its own "
                             f"process (only EngineCore's public methods are)")

    def shutdown(self) -> None:
        """Stop the core process (gracefully, then by force) and free the sockets; idempotent."""
        if self._finalizer.alive:
            self._dead = self._dead or EngineDeadError("the engine was shut down")
            self._finalizer()

    # ------------------------------------------------------------ transport

    def _send(self, msg: Any) -> None:
        if self._dead is not None:
            raise self._dead
        self._inputs.send(self._encoder.encode(msg), copy=False)

    def _receive(self, timeout_ms: int) -> None:
        """Handle every frame waiting (after waiting up to `timeout_ms` for the first)."""
        if self._dead is not None:
            raise self._dead
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        if self._outputs in events:
            while True:
                try:
                    frame = self._outputs.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frame.buffer)
        if self._dead is None and self._proc.sentinel in events:
            self._proc.join(1.0)
            self._dead = EngineDeadError(f"the engine-core process (pid {self.pid}) died "
                                         f"(exit code {self._proc.exitcode})")
        if self._dead is not None:
            logger.error("%s", self._dead)
            self._fail_pending()
            raise self._dead

    def _handle(self, frame: memoryview) -> None:
        try:
            msg = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("dropped an undecodable frame from the engine core socket (%d bytes): "
                         "%s", len(frame), e)
            return
        if isinstance(msg, wire.StepOutputs):
            self._pending.extend(msg.outputs)
            self._unfinished.difference_update(o.request_id for o in msg.outputs if o.finished)
            self._stats = msg.stats
            self._unacked_aborts -= msg.aborts_handled
            if msg.eplb_stats is not None:
                self.eplb_stats = msg.eplb_stats
        elif isinstance(msg, wire.UtilityResult):
            self._results[msg.call_id] = msg
        elif isinstance(msg, wire.Ready):
            self._ready = msg
        else:
            self._failure = msg.message
            self._dead = EngineDeadError(msg.message)

    def _fail_pending(self) -> None:
        """Hand the unfinished requests' callers nothing more: the raise that follows fails
        them (LLMEngine / AsyncLLM); forget them so nothing waits on them. (`shutdown()`
        releases the process and the sockets.)"""
        self._unfinished.clear()


class _OnlyKey:
    """ZeroMQ CURVE credentials check: the one client public key (z85) made for the core."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def callback(self, domain: str, key: bytes) -> bool:
        if key != self._key:
            logger.warning("refused a CURVE connection to the engine-core sockets with an "
                           "unknown key")
        return key == self._key


def _release(proc: CoreHandle | None, inputs: zmq.Socket, shutdown_frame: bytes,
             ctx: zmq.Context, auth: zmq.auth.thread.ThreadAuthenticator | None, path: str,
             pipe: tuple[int, int]) -> None:
    """Stop `proc` (ask it to shut down, then wait, terminate, kill), close the sockets, remove
    the socket folder (also run at interpreter exit for a client never shut down)."""
    if proc is not None:
        if proc.is_alive():
            try:
                inputs.send(shutdown_frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        proc.join(_SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(_SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if auth is not None:
        auth.stop()
    ctx.destroy(linger=0)
    shutil.rmtree(path, ignore_errors=True)
    for fd in pipe:
        os.close(fd)


def _rebuild_error(error: str) -> Exception:
    """The core's "TypeName: message" as an exception of that builtin type or of
    EngineSleepingError (else RuntimeError)."""
    name, _, message = error.partition(": ")
    if name == EngineSleepingError.__name__:
        return EngineSleepingError(message)
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(error)


def _convert_result(method: str, value: Any) -> Any:
    """`value` as `EngineCore.<method>`'s annotated return type (as it arrived if the
    annotation cannot be resolved)."""
    try:
        hint = typing.get_type_hints(getattr(EngineCore, method)).get("return")
    except (AttributeError, NameError, TypeError):
        return value
    if hint is None or hint is type(None):
        return value
    return msgspec.convert(value, hint, strict=False)
