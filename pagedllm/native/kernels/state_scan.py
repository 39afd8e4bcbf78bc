"""Python entry points of the recurrent layers' native CPU kernels (csrc/cpu_state_scan.cpp).

Each op runs the recurrence token by token inside each request of a varlen batch (prefill
chunks and decode tokens alike), from and into the request's state slot; see the C++ header for
the algorithms. `pagedllm/layers/state_kernels.py` picks these on the CPU; the torch references
are `pagedllm/layers/state_ops.py` and `pagedllm/layers/gated_delta_ops.py`.
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.native.kernels import abi, cpu_kernels

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The widest conv window the kernel takes (csrc/cpu_state_scan.cpp, kConvMaxWidth).
CONV_MAX_WIDTH = 16


class StateBatchArgs:
    """The `StateBatch` struct of one call, with the tensors it points into kept alive.

    Args:
        query_start_loc: [num_reqs + 1] int64, cumulative query lengths.
        state_indices: [num_reqs] int64, each request's slot.
        has_initial_state: [num_reqs] bool, False: start from a zero state.
        num_slots: the state tensors' first dim (slots out of [0, num_slots) are refused).
        emits: None, or (emit_start [num_reqs + 1], emit_offset [E], emit_slot [E]) int64: the
            state after token `emit_offset[e]` of request r's query (ascending inside each
            request, e in emit_start[r] .. emit_start[r + 1]) is also copied into slot
            `emit_slot[e]` (`StateCacheMetadata`'s block-boundary checkpoints).
    """

    def __init__(self, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                 has_initial_state: torch.Tensor, num_slots: int,
                 emits: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        self._qsl = query_start_loc.to(torch.int64).contiguous()
        self._slots = state_indices.to(torch.int64).contiguous()
        self._init = has_initial_state.to(torch.uint8).contiguous()
        r = self._slots.shape[0]
        if self._qsl.shape[0] != r + 1 or self._init.shape[0] != r:
            raise ValueError(f"state batch: {r} slots, {self._qsl.shape[0]} query starts and "
                             f"{self._init.shape[0]} initial-state flags (need R, R + 1, R)")
        self.num_tokens = int(self._qsl[-1]) if r else 0
        emit_ptrs = (None, None, None)
        if emits is not None and emits[1].numel():
            self._emits = tuple(t.to(torch.int64).contiguous() for t in emits)
            if (self._emits[0].shape[0] != r + 1
                    or self._emits[1].shape != self._emits[2].shape):
                raise ValueError(f"state batch: emit_start of {self._emits[0].shape[0]} entries "
                                 f"for {r} requests, or emit offsets and slots of unequal "
                                 f"lengths")
            emit_ptrs = tuple(t.data_ptr() for t in self._emits)
        self.struct = abi.struct("StateBatch")(self._qsl.data_ptr(), self._slots.data_ptr(),
                                               self._init.data_ptr(), r, num_slots, *emit_ptrs)

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self.struct)


def state_scan_supported(*tensors: torch.Tensor) -> bool:
    """Whether the native state kernels take these activations: CPU tensors of float32 or
    bfloat16 (all one dtype) and the built library."""
    return (all(t.device.type == "cpu" for t in tensors)
            and len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in _DTYPES
            and cpu_kernels() is not None)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: a request's state slot (or a slot it emits a checkpoint "
                         f"to) is out of range of the state tensor")


def causal_conv1d_varlen_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, batch: StateBatchArgs,
                             silu: bool = False) -> torch.Tensor:
    """Depthwise causal conv1d over the varlen batch with each request's window state (the
    native form of `layers.state_ops.causal_conv1d_varlen`, optionally with SiLU fused).

    Args:
        x: [num_tokens, C] float32/bfloat16 (rows may be strided, columns contiguous).
        weight: [C, K]; bias: [C] or None (computed in float32).
        conv_states: [num_slots, C, K - 1] float32/bfloat16, contiguous; read at and written to
            each request's slot.
        batch: the call's requests.
        silu: apply SiLU to the output.

    Returns:
        [num_tokens, C] in x's dtype.

    Raises:
        ValueError: shapes that do not match, a window over CONV_MAX_WIDTH taps, or a slot out
            of range.
    """
    n, c = x.shape
    k = weight.shape[-1]
    if not 1 <= k <= CONV_MAX_WIDTH:
        raise ValueError(f"causal_conv1d_varlen_cpu: a conv window of {k} taps (the kernel "
                         f"takes 1 to {CONV_MAX_WIDTH})")
    if (weight.shape != (c, k) or conv_states.shape[1:] != (c, k - 1) or n != batch.num_tokens
            or not conv_states.is_contiguous() or conv_states.dtype not in _DTYPES):
        raise ValueError(f"causal_conv1d_varlen_cpu: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}, conv_states {tuple(conv_states.shape)} "
                         f"{conv_states.dtype} for {batch.num_tokens} tokens do not match")
    if x.stride(1) != 1:
        x = x.contiguous()
    w = weight.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    out = torch.empty(n, c, dtype=x.dtype)
    rc = cpu_kernels().causal_conv1d_varlen_cpu(
        batch.ptr, x.data_ptr(), x.stride(0), c, k, w.data_ptr(),
        None if b is None else b.data_ptr(), conv_states.data_ptr(),
        _DTYPES[conv_states.dtype], int(silu), out.data_ptr(), _DTYPES[x.dtype])
    _check(rc, "causal_conv1d_varlen_cpu")
    return out


def ssd_scan_varlen_cpu(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        c: torch.Tensor, d: torch.Tensor, ssm_states: torch.Tensor,
                        batch: StateBatchArgs,
                        dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """Mamba-2's SSM over the varlen batch, token by token (the native form of
    `layers.state_ops.ssd_varlen`: same arguments, dt clamped to `dt_limit` only in requests
    with several query tokens, as HF's chunked path clamps).

    Args:
        x: [num_tokens, H, P]; b, c: [num_tokens, G, N] (x's dtype, float32/bfloat16);
        dt: [num_tokens, H] after softplus; a: [H] (A, negative); d: [H];
        ssm_states: [num_slots, H, P, N] float32, contiguous.

    Returns:
        y [num_tokens, H, P] float32 (y_t = h_t C_t + D x_t).

    Raises:
        ValueError: shapes that do not match, or a slot out of range.
    """
    n, h, p = x.shape
    g, sn = b.shape[1:]
    if (ssm_states.shape[1:] != (h, p, sn) or ssm_states.dtype != torch.float32
            or not ssm_states.is_contiguous() or c.shape != b.shape or dt.shape != (n, h)
            or h % g or n != batch.num_tokens):
        raise ValueError(f"ssd_scan_varlen_cpu: x {tuple(x.shape)}, B {tuple(b.shape)}, C "
                         f"{tuple(c.shape)}, dt {tuple(dt.shape)}, states "
                         f"{tuple(ssm_states.shape)} {ssm_states.dtype} do not match")
    x, b, c = x.contiguous(), b.contiguous(), c.contiguous()
    dt32, a32, d32 = dt.float().contiguous(), a.float().contiguous(), d.float().contiguous()
    y = torch.empty(n, h, p, dtype=torch.float32)
    lo, hi = dt_limit if dt_limit is not None else (0.0, float("inf"))
    rc = cpu_kernels().ssd_scan_varlen_cpu(
        batch.ptr, x.data_ptr(), dt32.data_ptr(), a32.data_ptr(), b.data_ptr(), c.data_ptr(),
        d32.data_ptr(), ssm_states.data_ptr(), h, p, g, sn, lo, hi, int(dt_limit is not None),
        _DTYPES[x.dtype], y.data_ptr())
    _check(rc, "ssd_scan_varlen_cpu")
    return y


def gated_delta_rule_varlen_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
                                batch: StateBatchArgs) -> torch.Tensor:
    """The gated delta rule over the varlen batch, token by token (the native form of
    `layers.gated_delta_ops.gated_delta_rule_varlen`; q and k are L2-normalised here, q scaled
    by d_k^-1/2).

    Args:
        q, k: [num_tokens, H_k, d_k] raw, H_k dividing H (value head h reads key head
            h // (H / H_k), so grouped heads need no repeat); v: [num_tokens, H, d_v] (q's dtype,
            float32/bfloat16); g (log decay), beta: [num_tokens, H];
        states: [num_slots, H, d_k, d_v] float32, contiguous.

    Returns:
        o [num_tokens, H, d_v] float32.

    Raises:
        ValueError: shapes that do not match, or a slot out of range.
    """
    n, hk, dk = q.shape
    h, dv = v.shape[1:]
    if (k.shape != q.shape or states.shape[1:] != (h, dk, dv) or states.dtype != torch.float32
            or not states.is_contiguous() or h % hk or g.shape != (n, h)
            or beta.shape != (n, h) or n != batch.num_tokens):
        raise ValueError(f"gated_delta_rule_varlen_cpu: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, states "
                         f"{tuple(states.shape)} {states.dtype} do not match")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g32, b32 = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(n, h, dv, dtype=torch.float32)
    rc = cpu_kernels().gated_delta_rule_varlen_cpu(
        batch.ptr, q.data_ptr(), k.data_ptr(), v.data_ptr(), g32.data_ptr(), b32.data_ptr(),
        states.data_ptr(), h, hk, dk, dv, _DTYPES[q.dtype], out.data_ptr())
    _check(rc, "gated_delta_rule_varlen_cpu")
    return out
