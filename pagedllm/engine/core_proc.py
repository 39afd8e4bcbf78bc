"""The engine core's own process (vLLM V1's EngineCoreProc): `run_engine_core` is its entry point.

    front end process (core_client.MPEngineCoreClient)        engine-core process (this module)
    ──────────────────────────────────────────────────        ────────────────────────────────
    add_request / abort_requests / call_utility ──PUSH──► PULL  handle inputs between steps
                                                                 EngineCore.step() while busy
    step(): outputs, stats, utility results   ◄──PULL── PUSH    StepOutputs after every step

The front end binds both IPC sockets in a private (0700) directory and this process connects to
them: it listens on nothing. Frames are decoded into declared types only (core_serial.py).

The loop: take every waiting input (blocking while the core has nothing to do), run one step,
send its outputs with the scheduler's stats. A request the core's own guard refuses (id in use,
can never fit: the front end checks both first) comes back as an "error" output for that request
only; an exception in a step is engine-wide: the process reports `EngineFailed` and exits 1.
It also exits when its parent (the front end) is gone, so no engine process outlives its server.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import sys
import typing
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine import core_serial as wire
from pagedllm.engine.engine_core import EngineCore
from pagedllm.logger import init_logger
from pagedllm.platforms import current_platform

logger = logging.getLogger(__name__)

# Milliseconds an idle core waits for input before it checks that its parent still lives.
_IDLE_POLL_MS = 500


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent_pid: int) -> None:
    """Process entry point: build the core, report `Ready`, serve until `Shutdown` or failure.

    Exits with status 1 after reporting `EngineFailed` when start-up or a step fails.
    """
    init_logger()
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    outputs = ctx.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    encoder = wire.make_encoder()
    code = 0
    try:
        current_platform.configure_options()
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, then exit
        logger.exception("the engine core failed to start")
        outputs.send(encoder.encode(wire.EngineFailed(f"{type(e).__name__}: {e}")))
        code = 1
    else:
        # As LLMEngine does in-process: the objects made so far live as long as the core; keep
        # them out of the cyclic collector's full passes.
        gc.collect()
        gc.freeze()
        outputs.send(encoder.encode(wire.Ready(core.num_blocks, core.kv_cache_capacity,
                                               core.kv_cache_bytes_per_token)))
        try:
            EngineCoreProc(core, inputs, outputs, parent_pid).run()
        except BaseException as e:  # noqa: BLE001 - reported to the front end, then exit
            logger.exception("the engine core failed")
            outputs.send(encoder.encode(wire.EngineFailed(
                f"the engine core failed: {type(e).__name__}: {e}")))
            code = 1
        finally:
            core.shutdown()
    outputs.close(linger=2000)
    inputs.close(linger=0)
    ctx.term()
    sys.exit(code)


class EngineCoreProc:
    """Serves one `EngineCore` over the two sockets (see the module docstring).

    Args:
        core: the engine core (built in this process).
        inputs: a connected zmq PULL socket (front end -> core).
        outputs: a connected zmq PUSH socket (core -> front end).
        parent_pid: the front end's pid; the loop ends when the parent changes (it died).
    """

    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket,
                 parent_pid: int) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.encoder = wire.make_encoder()
        self.decoder = wire.make_input_decoder()
        self._stopping = False

    def run(self) -> None:
        while not self._stopping:
            self._process_inputs(block=not self.core.has_unfinished_requests())
            if self._stopping:
                return
            if self.core.has_unfinished_requests():
                self._send_outputs(self.core.step())

    def _process_inputs(self, block: bool) -> None:
        refused: list[EngineCoreOutput] = []
        timeout = _IDLE_POLL_MS if block else 0
        aborted = False
        while self.inputs.poll(timeout):
            timeout = 0
            aborted |= self._handle(self.inputs.recv(copy=False).buffer, refused)
            if self._stopping:
                return
        if os.getppid() != self.parent_pid:
            logger.error("the front end (pid %d) is gone; the engine core exits",
                         self.parent_pid)
            self._stopping = True
        if refused or (aborted and not self.core.has_unfinished_requests()):
            # (With requests left, the next step's outputs carry the fresh stats.)
            self._send_outputs(refused)

    def _handle(self, frame: memoryview, refused: list[EngineCoreOutput]) -> bool:
        """Act on one input frame; True if it aborted requests."""
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
                refused.append(EngineCoreOutput(msg.request_id, [], finish_reason="error",
                                                error=f"refused by the engine core: {e}"))
        elif isinstance(msg, wire.AbortRequests):
            self.core.abort_requests(msg.request_ids)
            return True
        elif isinstance(msg, wire.CallUtility):
            self.outputs.send(self.encoder.encode(self._call_utility(msg)))
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

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self.outputs.send(self.encoder.encode(wire.StepOutputs(
            outputs, self.core.get_stats(), self.core.eplb_stats)))


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
