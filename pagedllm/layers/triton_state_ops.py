"""Triton kernels of the recurrent layers' ops for CUDA (the GPU twins of
`native/kernels/csrc/cpu_state_scan.cpp`; same arguments as the torch references in
`layers/state_ops.py` and `layers/gated_delta_ops.py`, chosen by `layers/state_kernels.py`).

Each program owns a tile of one request's state in registers and runs the recurrence token by
token over the request's tokens of the step (prefill chunk or decode token alike), then writes
the tile back to the request's slot; after a token the step lists as a block boundary (the
metadata's `emit_*`, prefix-caching mode "align") it also stores the tile into that boundary's
slot (a masked store: no branch in the loop):

    causal conv1d       program (request, channel block): the K-tap window read from the
                        request's inputs or, before them, its conv state
    Mamba-2 SSM         program (request, head, P block):   h [BP, N]
                        h = exp(dt A) h + dt x B^T,  y = h C + D x   (Dao & Gu 2024)
    gated delta rule    program (request, head, d_v block): S [d_k, BV]
                        S = exp(g) S;  S += k ((v - S^T k) beta)^T;  o = S^T q
                        (Yang et al., "Gated Delta Networks", ICLR 2025; FLA's
                        fused_recurrent_gated_delta_rule splits d_v the same way)

The token loop is sequential (no chunked matrix form): simple and exact for decode, where it is
the whole cost; for long prefills on a GPU a chunked kernel (FLA's chunk_gated_delta_rule,
mamba_ssm's chunk scan) would be faster and is not written here. Tested on the CPU under
TRITON_INTERPRET=1 against the torch references (tests/layers/test_state_kernels_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedllm.layers.state_cache import StateCacheMetadata


@triton.jit
def _boundary_slot(e, e_end, offset, emit_off_ptr, emit_slot_ptr):
    """(hit, slot): whether the request's next boundary entry `e` (of [e, e_end)) is at query
    offset `offset`, and its state slot (int64; 0 when not hit, the null slot)."""
    ei = tl.where(e < e_end, e, 0)          # the emit arrays have an element 0 always
    hit = (e < e_end) & (tl.load(emit_off_ptr + ei) == offset)
    return hit, tl.where(hit, tl.load(emit_slot_ptr + ei), 0).to(tl.int64)


@triton.jit
def _conv1d_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
                   emit_start_ptr, emit_off_ptr, emit_slot_ptr,
                   stride_x, C, K: tl.constexpr, KPAD: tl.constexpr, BC: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    r = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(qsl_ptr + r)
    end = tl.load(qsl_ptr + r + 1)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r).to(tl.float32)   # 1: continue the slot's state, 0: zeros
    c = cb * BC + tl.arange(0, BC)
    cmask = c < C
    kk = tl.arange(0, KPAD)
    kmask = kk < K
    w = tl.load(w_ptr + c[:, None] * K + kk[None, :], mask=cmask[:, None] & kmask[None, :],
                other=0.0)
    bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=cmask, other=0.0)
    state_base = state_ptr + slot * C * (K - 1) + c[:, None] * (K - 1)
    e = tl.load(emit_start_ptr + r)
    e_end = tl.load(emit_start_ptr + r + 1)
    j = tl.arange(0, KPAD)
    jmask = j < K - 1
    for t in range(start, end):
        idx = (t - start) - (K - 1) + kk                                 # [KPAD] input index
        xm = cmask[:, None] & (kmask & (idx >= 0))[None, :]
        xv = tl.load(x_ptr + (start + idx)[None, :] * stride_x + c[:, None], mask=xm, other=0.0)
        sm = cmask[:, None] & (kmask & (idx < 0))[None, :]
        sv = tl.load(state_base + (K - 1 + idx)[None, :], mask=sm, other=0.0) * init
        acc = tl.sum(w * (xv.to(tl.float32) + sv.to(tl.float32)), axis=1) + bias
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + t * C + c, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        # A block boundary: the window after this token (the taps just read, less the oldest).
        hit, emit = _boundary_slot(e, e_end, t - start, emit_off_ptr, emit_slot_ptr)
        # (a scalar condition enters masks through tl.where: `mask & scalar` fails in
        # triton's interpreter)
        wm = tl.where(hit & (emit != 0), cmask[:, None] & jmask[None, :], False)
        widx = (t - start) - (K - 1) + 1 + j
        wx = tl.load(x_ptr + (start + widx)[None, :] * stride_x + c[:, None],
                     mask=wm & (widx >= 0)[None, :], other=0.0)
        ws = tl.load(state_base + (K - 1 + widx)[None, :], mask=wm & (widx < 0)[None, :],
                     other=0.0) * init
        tl.store(state_ptr + emit * C * (K - 1) + c[:, None] * (K - 1) + j[None, :],
                 (wx.to(tl.float32) + ws.to(tl.float32)).to(state_ptr.dtype.element_ty),
                 mask=wm)
        e += hit.to(e.dtype)
    # The new window: the last K - 1 inputs (from the state when the request has fewer).
    length = end - start
    idx = length - (K - 1) + j
    xm = cmask[:, None] & (jmask & (idx >= 0))[None, :]
    xv = tl.load(x_ptr + (start + idx)[None, :] * stride_x + c[:, None], mask=xm, other=0.0)
    sm = cmask[:, None] & (jmask & (idx < 0))[None, :]
    sv = tl.load(state_base + (j + length)[None, :], mask=sm, other=0.0) * init
    new = xv.to(tl.float32) + sv.to(tl.float32)
    tl.store(state_base + j[None, :], new.to(state_ptr.dtype.element_ty),
             mask=cmask[:, None] & jmask[None, :])


@triton.jit
def _ssd_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, y_ptr, qsl_ptr, slots_ptr,
                init_ptr, emit_start_ptr, emit_off_ptr, emit_slot_ptr, dt_min, dt_max, H, G, P,
                N, CLAMP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    start = tl.load(qsl_ptr + r)
    end = tl.load(qsl_ptr + r + 1)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r).to(tl.float32)   # 1: continue the slot's state, 0: zeros
    p = pb * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    pm, nm = p < P, n < N
    smask = pm[:, None] & nm[None, :]
    sptr = state_ptr + ((slot * H + h) * P + p[:, None]) * N + n[None, :]
    s = tl.load(sptr, mask=smask, other=0.0) * init
    a = tl.load(a_ptr + h)
    d = tl.load(d_ptr + h)
    g = h // (H // G)
    clamp = CLAMP & (end - start > 1)
    e = tl.load(emit_start_ptr + r)
    e_end = tl.load(emit_start_ptr + r + 1)
    for t in range(start, end):
        dt = tl.load(dt_ptr + t * H + h)
        if clamp:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + (t * H + h) * P + p, mask=pm, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + (t * G + g) * N + n, mask=nm, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + (t * G + g) * N + n, mask=nm, other=0.0).to(tl.float32)
        s = s * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(s * cv[None, :], axis=1) + d * x
        tl.store(y_ptr + (t * H + h) * P + p, y, mask=pm)
        hit, emit = _boundary_slot(e, e_end, t - start, emit_off_ptr, emit_slot_ptr)
        tl.store(state_ptr + ((emit * H + h) * P + p[:, None]) * N + n[None, :], s,
                 mask=tl.where(hit & (emit != 0), smask, False))
        e += hit.to(e.dtype)
    tl.store(sptr, s, mask=smask)


@triton.jit
def _gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, qsl_ptr,
                        slots_ptr, init_ptr, emit_start_ptr, emit_off_ptr, emit_slot_ptr,
                        scale, H, HK, DK, DV, BK: tl.constexpr,
                        BV: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(qsl_ptr + r)
    end = tl.load(qsl_ptr + r + 1)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r).to(tl.float32)   # 1: continue the slot's state, 0: zeros
    kd = tl.arange(0, BK)
    vd = vb * BV + tl.arange(0, BV)
    km, vm = kd < DK, vd < DV
    smask = km[:, None] & vm[None, :]
    sptr = state_ptr + ((slot * H + h) * DK + kd[:, None]) * DV + vd[None, :]
    s = tl.load(sptr, mask=smask, other=0.0) * init
    hk = h // (H // HK)
    e = tl.load(emit_start_ptr + r)
    e_end = tl.load(emit_start_ptr + r + 1)
    for t in range(start, end):
        q = tl.load(q_ptr + (t * HK + hk) * DK + kd, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (t * HK + hk) * DK + kd, mask=km, other=0.0).to(tl.float32)
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + (t * H + h) * DV + vd, mask=vm, other=0.0).to(tl.float32)
        s = s * tl.exp(tl.load(g_ptr + t * H + h))
        delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + t * H + h)
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (t * H + h) * DV + vd, o, mask=vm)
        hit, emit = _boundary_slot(e, e_end, t - start, emit_off_ptr, emit_slot_ptr)
        tl.store(state_ptr + ((emit * H + h) * DK + kd[:, None]) * DV + vd[None, :], s,
                 mask=tl.where(hit & (emit != 0), smask, False))
        e += hit.to(e.dtype)
    tl.store(sptr, s, mask=smask)


# Whether this module's kernels were decorated for triton's interpreter (TRITON_INTERPRET=1 at
# import; they then run on CPU tensors).
INTERPRETED: bool = isinstance(_gated_delta_kernel, InterpretedFunction)


def _batch(meta: StateCacheMetadata) -> tuple[torch.Tensor, ...]:
    """query starts, slots, initial-state flags, emit starts, emit offsets, emit slots (the
    last two of one element when there are no emits: never read then)."""
    emits = (meta.emit_offset, meta.emit_slot)
    if meta.num_emits == 0:
        emits = tuple(torch.zeros(1, dtype=torch.int64, device=meta.emit_start.device)
                      for _ in emits)
    return (meta.query_start_loc.to(torch.int64), meta.state_indices.to(torch.int64),
            meta.has_initial_state.to(torch.int32), meta.emit_start.to(torch.int64),
            *(t.to(torch.int64).contiguous() for t in emits))


def causal_conv1d_varlen_triton(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None, conv_states: torch.Tensor,
                                meta: StateCacheMetadata, silu: bool = False) -> torch.Tensor:
    """`state_ops.causal_conv1d_varlen` (+ SiLU when `silu`). x: [num_tokens, C] (row stride
    free, columns contiguous); weight [C, K]; conv_states [num_slots, C, K - 1] contiguous.
    Returns [num_tokens, C] in x's dtype."""
    n, c = x.shape
    k = weight.shape[-1]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(n, c, dtype=x.dtype, device=x.device)
    if meta.num_reqs == 0:
        return out
    batch = _batch(meta)
    w = weight.float().contiguous()
    b = w if bias is None else bias.float().contiguous()
    bc = 64
    _conv1d_kernel[(meta.num_reqs, triton.cdiv(c, bc))](
        x, w, b, conv_states, out, *batch, x.stride(0), c, K=k,
        KPAD=triton.next_power_of_2(k), BC=bc, HAS_BIAS=bias is not None, SILU=silu)
    return out


def ssd_varlen_triton(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      c: torch.Tensor, d: torch.Tensor, ssm_states: torch.Tensor,
                      meta: StateCacheMetadata,
                      dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """`state_ops.ssd_varlen` token by token (dt clamped only in multi-token requests).
    x [num_tokens, H, P]; b, c [num_tokens, G, N]; ssm_states [num_slots, H, P, N] float32.
    Returns y [num_tokens, H, P] float32."""
    n, h, p = x.shape
    g, sn = b.shape[1:]
    y = torch.empty(n, h, p, dtype=torch.float32, device=x.device)
    if meta.num_reqs == 0:
        return y
    batch = _batch(meta)
    lo, hi = dt_limit if dt_limit is not None else (0.0, float("inf"))
    bp = min(32, triton.next_power_of_2(p))
    _ssd_kernel[(meta.num_reqs, h, triton.cdiv(p, bp))](
        x.contiguous(), dt.float().contiguous(), a.float().contiguous(), b.contiguous(),
        c.contiguous(), d.float().contiguous(), ssm_states, y, *batch, lo, hi, h, g,
        p, sn, CLAMP=dt_limit is not None, BP=bp, BN=triton.next_power_of_2(sn))
    return y


def gated_delta_rule_varlen_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
                                   meta: StateCacheMetadata) -> torch.Tensor:
    """`gated_delta_ops.gated_delta_rule_varlen` token by token; q, k [num_tokens, H_k, d_k]
    raw (H_k dividing H), v [num_tokens, H, d_v], g, beta [num_tokens, H], states
    [num_slots, H, d_k, d_v] float32. Returns o [num_tokens, H, d_v] float32."""
    n, hk, dk = q.shape
    h, dv = v.shape[1:]
    out = torch.empty(n, h, dv, dtype=torch.float32, device=q.device)
    if meta.num_reqs == 0:
        return out
    batch = _batch(meta)
    bv = min(32, triton.next_power_of_2(dv))
    _gated_delta_kernel[(meta.num_reqs, h, triton.cdiv(dv, bv))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), states, out, *batch, dk ** -0.5, h, hk, dk, dv,
        BK=triton.next_power_of_2(dk), BV=bv)
    return out
