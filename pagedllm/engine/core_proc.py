"""The engine core's own process (vLLM V1's EngineCoreProc): `run_engine_core` is its entry point.

    front end process (core_client.MPEngineCoreClient)        engine-core process (this module)
    ──────────────────────────────────────────────────        ────────────────────────────────
    add_request / abort_requests / call_utility ──PUSH──► PULL  handle inputs between steps
                                                                 EngineCore.step() while busy
    step(): outputs, stats, utility results   ◄──PULL── PUSH    StepOutputs after every step

The front end binds both sockets and this process connects to them: it listens on nothing. On one
machine they are IPC sockets in a private (0700) directory; a core on another machine (a Ray
actor, core_ray.py) connects over TCP with CURVE (ZeroMQ's encryption and authentication: the
front end accepts only the key pair it made for this core). Frames are decoded into declared
types only (core_serial.py).

The loop: take every waiting input (blocking while the core has nothing to do), run one step,
send its outputs with the scheduler's stats. A request the core's own guard refuses (id in use,
can never fit: the front end checks both first) comes back as an "error" output for that request
only; an exception in a step is engine-wide: the process reports `EngineFailed` and exits 1.
It also exits when its parent (the front end) is gone, so no engine process outlives its server
(a Ray actor has no such parent: Ray ends an actor whose owner, the front end, died).

Signals: the process ignores SIGTERM and SIGINT. Both reach a whole process group at once (a
terminal's Ctrl-C, systemd's stop or `kill -TERM -<pgid>`), and the front ends, which get them
too, shut down gracefully: they finish or fail their open requests through this core, so it must
outlive them. It stops when its front end says so: the `Shutdown` message (a core of one front
end), the launcher's stop pipe (the API-server pool: EOF or a byte), or its parent's death; a
process that must go at once is killed (SIGKILL), which the front ends see as an engine death.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import signal
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine import core_serial as wire
from pagedllm.engine.core_stat_shares import CounterShares
from pagedllm.engine.engine_core import EngineCore
from pagedllm.logger import init_logger
from pagedllm.platforms import current_platform

logger = logging.getLogger(__name__)

# Milliseconds an idle core waits for input before it checks that its parent still lives.
_IDLE_POLL_MS = 500


@dataclass(frozen=True)
class CoreEndpoints:
    """Where an engine core connects: the front end's two sockets and, for TCP, the CURVE keys
    (z85 bytes) of this core's key pair and of the front end (None on IPC).

    Attributes:
        input_address, output_address: ZeroMQ endpoints ("ipc://..." or "tcp://host:port").
        curve_server_key: the front end's public key.
        curve_public_key, curve_secret_key: the key pair the front end made for this core and
            accepts alone.
    """

    input_address: str
    output_address: str
    curve_server_key: bytes | None = None
    curve_public_key: bytes | None = None
    curve_secret_key: bytes | None = None


def run_engine_core(config: EngineConfig, endpoints: CoreEndpoints | Sequence[CoreEndpoints],
                    parent_pid: int, stop: Connection | None = None) -> None:
    """Process entry point: ignore SIGTERM and SIGINT (see the module docstring; the worker
    processes of its executor inherit that), `serve_engine_core`, then exit with its status."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(serve_engine_core(config, endpoints, parent_pid, stop))


def serve_engine_core(config: EngineConfig, endpoints: CoreEndpoints | Sequence[CoreEndpoints],
                      parent_pid: int | None, stop: Connection | None = None) -> int:
    """Build the core, report `Ready` to every front end (one per `endpoints`: several API
    server processes share a core), serve until `Shutdown` or failure; `parent_pid`: stop when
    this process's parent is no longer that process (None: no such check); `stop`: the read
    end of a pipe whose EOF (or any byte) stops the core as `Shutdown` does (None: none).

    Returns:
        0 after Shutdown; 1 after reporting `EngineFailed` (start-up or a step failed).
    """
    init_logger()
    clients = [endpoints] if isinstance(endpoints, CoreEndpoints) else list(endpoints)
    ctx = zmq.Context()
    inputs = [ctx.socket(zmq.PULL) for _ in clients]
    outputs = [ctx.socket(zmq.PUSH) for _ in clients]
    for client, pull, push in zip(clients, inputs, outputs):
        for sock in (pull, push):
            if client.curve_server_key is not None:
                sock.curve_serverkey = client.curve_server_key
                sock.curve_publickey = client.curve_public_key
                sock.curve_secretkey = client.curve_secret_key
            if client.input_address.startswith("tcp://["):
                sock.ipv6 = True
        pull.connect(client.input_address)
        push.connect(client.output_address)
    encoder = wire.make_encoder()

    def send_all(msg: Any) -> None:
        frame = encoder.encode(msg)
        for push in outputs:
            push.send(frame)

    code = 0
    try:
        current_platform.configure_options()
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, then exit
        logger.exception("the engine core failed to start")
        send_all(wire.EngineFailed(f"{type(e).__name__}: {e}"))
        code = 1
    else:
        # As LLMEngine does in-process: the objects made so far live as long as the core; keep
        # them out of the cyclic collector's full passes.
        gc.collect()
        gc.freeze()
        send_all(wire.Ready(core.num_blocks, core.kv_cache_capacity,
                            core.kv_cache_bytes_per_token))
        try:
            EngineCoreProc(core, inputs, outputs, parent_pid, stop).run()
        except BaseException as e:  # noqa: BLE001 - reported to the front end, then exit
            logger.exception("the engine core failed")
            send_all(wire.EngineFailed(f"the engine core failed: {type(e).__name__}: {e}"))
            code = 1
        finally:
            core.shutdown()
    for push in outputs:
        push.close(linger=2000)
    for pull in inputs:
        pull.close(linger=0)
    ctx.term()
    return code


class EngineCoreProc:
    """Serves one `EngineCore` to one or more front ends (see the module docstring).

    Args:
        core: the engine core (built in this process).
        inputs, outputs: per front end, a connected zmq PULL socket (front end -> core) and
            PUSH socket (core -> front end). A request's outputs and a utility call's result go
            to the front end it came from; each front end with requests on this core gets the
            scheduler's stats after every step, every front end when the core falls idle. With
            several front ends each receives its share of the counters (core_stat_shares.py),
            so that their sum is the core's count.
        parent_pid: the front end's pid; the loop ends when the parent changes (it died).
            None: no parent to watch (a Ray actor).
        stop: the read end of the launcher's stop pipe; the loop ends when it is readable (a
            byte, or EOF: the launcher closed it or died). None: no such pipe.
    """

    def __init__(self, core: EngineCore, inputs: zmq.Socket | Sequence[zmq.Socket],
                 outputs: zmq.Socket | Sequence[zmq.Socket], parent_pid: int | None,
                 stop: Connection | None = None) -> None:
        self.core = core
        self.inputs = [inputs] if isinstance(inputs, zmq.Socket) else list(inputs)
        self.outputs = [outputs] if isinstance(outputs, zmq.Socket) else list(outputs)
        self.parent_pid = parent_pid
        self.encoder = wire.make_encoder()
        self.decoder = wire.make_input_decoder()
        self._stopping = False
        self._poller = zmq.Poller()
        for sock in self.inputs:
            self._poller.register(sock, zmq.POLLIN)
        self._stop_fd = None if stop is None else stop.fileno()
        if self._stop_fd is not None:
            self._poller.register(self._stop_fd, zmq.POLLIN)
        self._client_of_socket = {sock: i for i, sock in enumerate(self.inputs)}
        self._client_of: dict[str, int] = {}   # unfinished request id -> front end
        # Per front end: AbortRequests acted on since its last StepOutputs (which acknowledges
        # them).
        self._aborts_handled = [0] * len(self.inputs)
        self._shares = (CounterShares(len(self.outputs), core.get_stats(), core.eplb_stats)
                        if len(self.outputs) > 1 else None)

    def run(self) -> None:
        while not self._stopping:
            self._process_inputs(block=not self.core.has_unfinished_requests())
            if self._stopping:
                return
            if self.core.has_unfinished_requests():
                self._send_outputs(self.core.step())

    def _process_inputs(self, block: bool) -> None:
        refused: list[tuple[int, EngineCoreOutput]] = []
        timeout = _IDLE_POLL_MS if block else 0
        aborted = False
        while events := self._poller.poll(timeout):
            timeout = 0
            for sock, _ in events:
                if sock == self._stop_fd:
                    logger.info("the launcher stops the engine core")
                    self._stopping = True
                    return
                client = self._client_of_socket[sock]
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    aborted |= self._handle(client, frame.buffer, refused)
                    if self._stopping:
                        return
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.error("the front end (pid %d) is gone; the engine core exits",
                         self.parent_pid)
            self._stopping = True
        if refused or (aborted and not self.core.has_unfinished_requests()):
            # (With requests left, the next step's outputs carry the fresh stats.)
            self._send_outputs([], refused)

    def _handle(self, client: int, frame: memoryview,
                refused: list[tuple[int, EngineCoreOutput]]) -> bool:
        """Act on one input frame of front end `client`; True if it aborted requests."""
        try:
            msg = self.decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # Not a frame of ours: dropped, never interpreted further.
            logger.error("dropped an undecodable input frame (%d bytes): %s", len(frame), e)
            return False
        if isinstance(msg, wire.AddRequest):
            try:
                self.core.add_request(wire.request_from_wire(msg))
            except Exception as e:  # noqa: BLE001 - the core's guard refused it: it fails alone
                refused.append((client, EngineCoreOutput(
                    msg.request_id, [], finish_reason="error",
                    error=f"refused by the engine core: {e}")))
            else:
                self._client_of[msg.request_id] = client
        elif isinstance(msg, wire.AbortRequests):
            self.core.abort_requests(msg.request_ids)
            for request_id in msg.request_ids:
                self._client_of.pop(request_id, None)
            self._aborts_handled[client] += 1
            return True
        elif isinstance(msg, wire.CallUtility):
            result = self._call_utility(msg)
            # The stats after the call go first (it may have reset counters, e.g. the prefix
            # cache's): the caller's get_stats() right after the call sees them.
            stats, eplb = self.core.get_stats(), self.core.eplb_stats
            if self._shares is not None:
                self._shares.rebase(stats, eplb)
                stats, eplb = self._shares.view(client, stats, eplb)
            self.outputs[client].send(self.encoder.encode(wire.StepOutputs([], stats, eplb)))
            self.outputs[client].send(self.encoder.encode(result))
        else:
            self._stopping = True
        return False

    def _call_utility(self, msg: wire.CallUtility) -> wire.UtilityResult:
        try:
            method = utility_method(self.core, msg.method)
            result = method(*convert_args(method, msg.args))
        except Exception as e:  # noqa: BLE001 - the caller's error, raised on its side
            return wire.UtilityResult(msg.call_id, None, f"{type(e).__name__}: {e}")
        try:
            self.encoder.encode(result)
        except (TypeError, NotImplementedError) as e:
            return wire.UtilityResult(msg.call_id, None, f"TypeError: the result of "
                                      f"{msg.method} cannot cross processes: {e}")
        return wire.UtilityResult(msg.call_id, result, None)

    def _send_outputs(self, outputs: list[EngineCoreOutput],
                      refused: Sequence[tuple[int, EngineCoreOutput]] = ()) -> None:
        """Send each front end its requests' outputs with the stats: those with requests on
        this core or aborts to acknowledge, every one when the core is idle."""
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        busy = set(self._client_of.values())
        for out in outputs:
            client = self._client_of.get(out.request_id, 0)
            per_client[client].append(out)
            if out.finished:
                self._client_of.pop(out.request_id, None)
        for client, out in refused:
            per_client[client].append(out)
        idle = not self.core.has_unfinished_requests()
        recipients = [client for client in range(len(self.outputs))
                      if per_client[client] or self._aborts_handled[client] or client in busy
                      or idle]
        stats, eplb = self.core.get_stats(), self.core.eplb_stats
        if self._shares is not None and recipients:
            # The counters' increments go to a front end that records them now: one with
            # outputs, else with requests on the core, else with aborts acknowledged.
            self._shares.give(min(recipients, key=lambda c: (
                not per_client[c], c not in busy, not self._aborts_handled[c], c)), stats, eplb)
        for client in recipients:
            mine, my_eplb = (self._shares.view(client, stats, eplb)
                             if self._shares is not None else (stats, eplb))
            self.outputs[client].send(self.encoder.encode(wire.StepOutputs(
                per_client[client], mine, my_eplb, self._aborts_handled[client])))
            self._aborts_handled[client] = 0


def utility_method(core: Any, name: str):
    """`core`'s public method `name`.

    Raises:
        AttributeError: `name` is private (starts with "_") or no method of the core.
    """
    if name.startswith("_"):
        raise AttributeError(f"{name!r} is private; only public engine-core methods are called")
    method = getattr(core, name, None)
    if method is None or not inspect.ismethod(method):
        raise AttributeError(f"the engine core has no method {name!r}")
    return method


def convert_args(method: Any, args: list[Any]) -> list[Any]:
    """`args` converted to `method`'s annotated parameter types (positional order; a parameter
    without an annotation takes the value as it arrived).

    Raises:
        TypeError: more arguments than parameters; msgspec.ValidationError: a value that does
            not fit its parameter's type.
    """
    params = list(inspect.signature(method).parameters.values())
    if len(args) > len(params) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(f"{method.__name__}() takes {len(params)} arguments, got {len(args)}")
    hints = typing.get_type_hints(method)
    converted = []
    for i, value in enumerate(args):
        param = params[min(i, len(params) - 1)]
        hint = hints.get(param.name)
        converted.append(value if hint is None else msgspec.convert(value, hint,
                                                                    strict=False))
    return converted
