"""The wire format between the front end and an engine-core process (core_client.py, core_proc.py).

Every message is one msgpack frame (msgspec) decoded into a declared type: a tagged union of the
structs below, whose fields are plain data (ints, floats, strings, lists, dicts and the engine's
plain dataclasses). Nothing that arrives on a socket is ever unpickled, so a peer that manages to
send bytes can at worst make a decode fail (`msgspec.DecodeError` / `ValidationError`), never make
the engine run code: vLLM shipped exactly that remote-code-execution bug (pickle over a ZeroMQ
socket bound to every interface, CVE-2025-30165), which this format rules out by construction.

`SamplingParams` crosses as a dict of its fields and is rebuilt through its constructor (so it is
validated again on arrival) plus the two engine-set fields; per-request `logits_processors`
(Python callables) cannot cross and are refused on the front end's side with a ValueError.
Utility calls (`CallUtility`) carry the method's arguments as plain values; the core converts them
to the method's annotated parameter types (`msgspec.convert`) before the call, and the client
converts the result to the annotated return type.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec
import numpy as np

from pagedllm.core.kv_cache_groups import KVCacheCapacity
from pagedllm.core.sched_output import EngineCoreOutput, EplbStats
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.engine_core import EngineCoreRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# SamplingParams fields the engine sets after validation (not constructor arguments).
_ENGINE_SET_FIELDS = ("_all_stop_token_ids", "_bad_words_token_ids")


# ------------------------------------------------------------------ front end -> engine core

class WireArray(msgspec.Struct, array_like=True):
    """A numpy array as its dtype name (one of `_WIRE_DTYPES`), shape and raw bytes."""

    dtype: str
    shape: list[int]
    data: bytes


class WireImage(msgspec.Struct, array_like=True):
    """A `MultiModalFeature` (multimodal/inputs.py): one image's placeholder range and its
    encoder inputs as arrays."""

    modality: str
    identifier: str
    offset: int
    length: int
    is_embed: WireArray
    data: dict[str, WireArray]
    bidirectional: bool


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    max_tokens: int
    arrival_time: float | None
    priority: int
    lora_request: LoRARequest | None
    mm_features: list[WireImage] | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class CallUtility(msgspec.Struct, tag="call", array_like=True):
    """Call the engine core's public method `method` with `args` (see module docstring)."""

    call_id: int
    method: str
    args: list[Any]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


InputMessage = Union[AddRequest, AbortRequests, CallUtility, Shutdown]


# ------------------------------------------------------------------ engine core -> front end

class Ready(msgspec.Struct, tag="ready", array_like=True):
    """Sent once the core has loaded the model and sized the KV cache."""

    num_blocks: int
    kv_cache_capacity: KVCacheCapacity
    kv_cache_bytes_per_token: int = 0


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """One step's per-request deltas and the scheduler's state after it; `aborts_handled`:
    the AbortRequests messages the core acted on since its previous StepOutputs."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    eplb_stats: EplbStats | None
    aborts_handled: int = 0


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    result: Any
    error: str | None  # "TypeName: message" when the call raised


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The core failed (at start-up or in a step) and exits; `message` says what failed."""

    message: str


OutputMessage = Union[Ready, StepOutputs, UtilityResult, EngineFailed]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise NotImplementedError(f"{type(obj).__name__} cannot cross to the engine-core process")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def make_input_decoder() -> msgspec.msgpack.Decoder:
    """Decodes front end -> core frames; raises msgspec.DecodeError / ValidationError on any
    frame that is not exactly one of `InputMessage`."""
    return msgspec.msgpack.Decoder(InputMessage)


def make_output_decoder() -> msgspec.msgpack.Decoder:
    """Decodes core -> front end frames (as `make_input_decoder`, for `OutputMessage`)."""
    return msgspec.msgpack.Decoder(OutputMessage)


# The only array dtypes an image's encoder inputs may cross in (nothing else is rebuilt).
_WIRE_DTYPES = frozenset({"float32", "float16", "int64", "int32", "uint8", "bool"})


def _array_to_wire(array: np.ndarray) -> WireArray:
    array = np.ascontiguousarray(array)
    if array.dtype.name not in _WIRE_DTYPES:
        raise ValueError(f"an image input array of dtype {array.dtype} cannot cross to the "
                         f"engine-core process")
    return WireArray(array.dtype.name, list(array.shape), array.tobytes())


def _array_from_wire(wire: WireArray) -> np.ndarray:
    """Raises ValueError: a dtype outside `_WIRE_DTYPES`, or bytes that do not fill the shape."""
    if wire.dtype not in _WIRE_DTYPES:
        raise ValueError(f"array dtype {wire.dtype!r} is not accepted")
    return np.frombuffer(wire.data, dtype=np.dtype(wire.dtype)).reshape(wire.shape).copy()


def _image_to_wire(feature: MultiModalFeature) -> WireImage:
    return WireImage(feature.modality, feature.identifier, feature.offset, feature.length,
                     _array_to_wire(feature.is_embed),
                     {k: _array_to_wire(v) for k, v in feature.data.items()},
                     feature.bidirectional)


def _image_from_wire(wire: WireImage) -> MultiModalFeature:
    return MultiModalFeature(wire.modality, wire.identifier, wire.offset, wire.length,
                             _array_from_wire(wire.is_embed).astype(bool),
                             {k: _array_from_wire(v) for k, v in wire.data.items()},
                             wire.bidirectional)


def request_to_wire(req: EngineCoreRequest) -> AddRequest:
    """Raises:
        ValueError: the request carries logits processors (callables cannot cross processes).
    """
    params = req.sampling_params
    if params.logits_processors:
        raise ValueError("logits_processors (Python callables) are not supported with the "
                         "engine core in its own process (multiprocess_mode); run in-process")
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
              if f.name != "logits_processors"}
    fields["output_kind"] = params.output_kind.value
    if params.structured_outputs is not None:
        fields["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return AddRequest(req.request_id, req.prompt_token_ids, fields, req.max_tokens,
                      req.arrival_time, req.priority, req.lora_request,
                      None if req.mm_features is None
                      else [_image_to_wire(f) for f in req.mm_features])


def request_from_wire(msg: AddRequest) -> EngineCoreRequest:
    """Rebuild the request; the sampling parameters pass their constructor's validation again.

    Raises:
        ValueError, TypeError, KeyError, msgspec.ValidationError: malformed sampling parameters
            or image arrays.
    """
    fields = dict(msg.sampling_params)
    engine_set = {name: fields.pop(name, None) for name in _ENGINE_SET_FIELDS}
    fields["output_kind"] = RequestOutputKind(fields["output_kind"])
    params = SamplingParams(**fields)
    params._all_stop_token_ids = set(msgspec.convert(engine_set["_all_stop_token_ids"] or [],
                                                     list[int]))
    params._bad_words_token_ids = msgspec.convert(engine_set["_bad_words_token_ids"] or [],
                                                  list[list[int]])
    return EngineCoreRequest(msg.request_id, msg.prompt_token_ids, params, msg.max_tokens,
                             msg.arrival_time, msg.priority, msg.lora_request,
                             None if msg.mm_features is None
                             else [_image_from_wire(f) for f in msg.mm_features])
