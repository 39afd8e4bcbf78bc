"""The recurrent layers' ops with the kernel chosen by device: what the models call.

    causal_conv1d_varlen     depthwise causal conv1d with a window state (+ optional SiLU)
    ssd_varlen               Mamba-2's SSM scan / update
    gated_delta_rule_varlen  Gated DeltaNet's gated delta rule

Backends, picked per call by `backend=None` (auto): "native" on the CPU when the C++ library
built (`native/kernels/state_scan.py`, a token-by-token scan in C++; float32/bfloat16
activations), "triton" on CUDA when triton is installed (`layers/triton_state_ops.py`), else
"torch", the vectorised references of `layers/state_ops.py` / `layers/gated_delta_ops.py` (kept
for tests and as the fallback). `PAGEDLLM_CPU_KERNELS=0` turns the native kernels off with the
others. The three backends compute the same recurrences; they differ in rounding only (the
chunked torch form regroups sums per chunk).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from pagedllm.layers import gated_delta_ops, state_ops
from pagedllm.layers.state_cache import StateCacheMetadata
from pagedllm.native.kernels import state_scan

BACKENDS = ("native", "triton", "torch")

# The backend of calls that name none; None: by device (benchmarks set "torch" to time the
# reference ops inside the engine, scripts/bench_hybrid_state.py).
DEFAULT_BACKEND: str | None = None

# One StateBatch struct per (step metadata, slot count): every layer of a step shares it.
_last_batch: tuple[StateCacheMetadata, int, state_scan.StateBatchArgs] | None = None


def _native_batch(meta: StateCacheMetadata, num_slots: int) -> state_scan.StateBatchArgs:
    global _last_batch
    if _last_batch is None or _last_batch[0] is not meta or _last_batch[1] != num_slots:
        _last_batch = (meta, num_slots, state_scan.StateBatchArgs(
            meta.query_start_loc, meta.state_indices, meta.has_initial_state, num_slots,
            (meta.emit_start, meta.emit_offset, meta.emit_slot) if meta.num_emits else None))
    return _last_batch[2]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def pick_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """The backend of a call: `backend` if given (one of BACKENDS), else `DEFAULT_BACKEND` if
    set, else by device.

    Raises:
        ValueError: an unknown backend name.
    """
    backend = backend if backend is not None else DEFAULT_BACKEND
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown state-op backend {backend!r}; expected one of {BACKENDS}")
        return backend
    device = tensors[0].device.type
    if device == "cpu" and state_scan.state_scan_supported(*tensors):
        return "native"
    if device == "cuda" and _triton_installed():
        return "triton"
    return "torch"


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, meta: StateCacheMetadata,
                         activation: str | None = None, backend: str | None = None
                         ) -> torch.Tensor:
    """`state_ops.causal_conv1d_varlen` (same shapes and state update), then `activation`
    (None or "silu"). Returns [num_tokens, C] in x's dtype.

    Raises:
        ValueError: an unknown activation or backend.
    """
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d_varlen: unknown activation {activation!r}")
    silu = activation == "silu"
    chosen = pick_backend(backend, x)
    if chosen == "native" and backend is None and weight.shape[-1] > state_scan.CONV_MAX_WIDTH:
        chosen = "torch"   # a window wider than the kernel takes (none of the models here)
    if chosen == "native":
        return state_scan.causal_conv1d_varlen_cpu(
            x, weight, bias, conv_states, _native_batch(meta, conv_states.shape[0]), silu)
    if chosen == "triton":
        from pagedllm.layers import triton_state_ops
        return triton_state_ops.causal_conv1d_varlen_triton(x, weight, bias, conv_states, meta,
                                                            silu)
    out = state_ops.causal_conv1d_varlen(x, weight, bias, conv_states, meta)
    return F.silu(out) if silu else out


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, d: torch.Tensor, ssm_states: torch.Tensor,
               meta: StateCacheMetadata, chunk_size: int,
               dt_limit: tuple[float, float] | None = None, backend: str | None = None
               ) -> torch.Tensor:
    """`state_ops.ssd_varlen` (same arguments and result: y [num_tokens, H, P] float32).
    `chunk_size` matters to the torch backend only (the kernels scan token by token)."""
    chosen = pick_backend(backend, x, b, c)
    if chosen == "native":
        return state_scan.ssd_scan_varlen_cpu(x, dt, a, b, c, d, ssm_states,
                                              _native_batch(meta, ssm_states.shape[0]), dt_limit)
    if chosen == "triton":
        from pagedllm.layers import triton_state_ops
        return triton_state_ops.ssd_varlen_triton(x, dt, a, b, c, d, ssm_states, meta, dt_limit)
    return state_ops.ssd_varlen(x, dt, a, b, c, d, ssm_states, meta, chunk_size, dt_limit)


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, states: torch.Tensor, meta: StateCacheMetadata,
                            chunk_size: int = 64, backend: str | None = None) -> torch.Tensor:
    """`gated_delta_ops.gated_delta_rule_varlen`, except that q and k may keep their H_k key
    heads ([num_tokens, H_k, d_k], H_k dividing the H value heads; value head h reads key head
    h // (H / H_k)). Returns o [num_tokens, H, d_v] float32."""
    chosen = pick_backend(backend, q, k, v)
    if chosen == "native":
        return state_scan.gated_delta_rule_varlen_cpu(q, k, v, g, beta, states,
                                                      _native_batch(meta, states.shape[0]))
    if chosen == "triton":
        from pagedllm.layers import triton_state_ops
        return triton_state_ops.gated_delta_rule_varlen_triton(q, k, v, g, beta, states, meta)
    per = v.shape[1] // q.shape[1]
    if per > 1:
        q, k = q.repeat_interleave(per, dim=1), k.repeat_interleave(per, dim=1)
    return gated_delta_ops.gated_delta_rule_varlen(q, k, v, g, beta, states, meta, chunk_size)
