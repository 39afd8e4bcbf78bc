"""Python entry points of the native CPU kernels (see `csrc/`), on torch tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.kv_cache_layout import is_quantized_kv_cache, kv_cache_scales
from pagedllm.native.kernels import abi, cpu_kernels

_LINEAR_DTYPES = (torch.float32, torch.bfloat16)


def cpu_linear_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `cpu_linear` can take these operands (CPU tensors, float32/bfloat16 weight laid out
    as [N, K] with K a multiple of 8, float32/bfloat16 activations) and the kernels built."""
    return (x.device.type == "cpu" and weight.device.type == "cpu"
            and weight.dtype in _LINEAR_DTYPES and x.dtype in _LINEAR_DTYPES
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] > 0
            and weight.shape[1] % 8 == 0 and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and cpu_kernels() is not None)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               checked: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias with the native kernel (weights widened in registers).

    Args:
        x: [..., K] float32 or bfloat16 (computed in float32; with a bf16 weight, bf16
            activations are read and written as bf16 by the kernel, rounded to nearest even).
        weight: [N, K] float32 or bfloat16, contiguous, K % 8 == 0 (see `cpu_linear_supported`).
        bias: [N] on the CPU, or None.
        checked: the caller already saw `cpu_linear_supported(x, weight)` return True.

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: if the operands are not supported (check `cpu_linear_supported` first).
    """
    if not checked and not cpu_linear_supported(x, weight):
        raise ValueError(
            f"cpu_linear does not support x {tuple(x.shape)} {x.dtype} with weight "
            f"{tuple(weight.shape)} {weight.dtype} (needs CPU tensors, float32/bfloat16, a "
            f"contiguous [N, K] weight with K a positive multiple of 8 matching x's last dim, "
            f"and the built kernels)")
    if (checked and bias is None and x.dtype is torch.float32 and weight.dtype is torch.float32
            and x.dim() == 2 and x.is_contiguous()):
        # Float32 rows (a router, a replicated projection) without the general path's no-op
        # casts and views (see NOTE(batch-1) in `packed_linear`).
        m, k, n = x.shape[0], x.shape[1], weight.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            cpu_kernels().linear_f32(x.data_ptr(), k, m, k, weight.data_ptr(), n, None,
                                     y.data_ptr(), n)
        return y
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device.type != "cpu"):
        raise ValueError(f"cpu_linear: bias must be a CPU tensor of shape ({weight.shape[0]},), "
                         f"got {tuple(bias.shape)} on {bias.device}")
    lead = x.shape[:-1]
    n = weight.shape[0]
    b = None if bias is None else bias.to(torch.float32).contiguous()
    lib = cpu_kernels()
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        fn, act_dtype = lib.linear_bf16_act, torch.bfloat16   # no casts around the call
    else:
        fn = lib.linear_f32 if weight.dtype == torch.float32 else lib.linear_bf16
        act_dtype = torch.float32
    x2 = x.reshape(-1, x.shape[-1]).to(act_dtype)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    y = torch.empty(m, n, dtype=act_dtype)
    fn(x2.data_ptr(), x2.stride(0), m, k, weight.data_ptr(), n,
       None if b is None else b.data_ptr(), y.data_ptr(), n)
    return y.view(*lead, n).to(x.dtype)


def packed_gemm_supported(weight: torch.Tensor) -> bool:
    """Whether `pack_linear_weight` takes `weight`: a contiguous float32/bfloat16 [N, K] CPU
    tensor with K a positive multiple of 8 (what `packed_linear` then computes on)."""
    return (weight.device.type == "cpu" and weight.dtype in _LINEAR_DTYPES
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[0] > 0
            and weight.shape[1] > 0 and weight.shape[1] % 8 == 0)


def _kernels(lib: ctypes.CDLL | None, what: str) -> ctypes.CDLL:
    """`lib`, else the process's native kernel library (`cpu_kernels`).

    Raises:
        RuntimeError: the native kernels are unavailable (names `what`, the caller).
    """
    lib = lib if lib is not None else cpu_kernels()
    if lib is None:
        raise RuntimeError(f"{what} needs the native CPU kernels, which are unavailable (see the "
                           f"log; PAGEDLLM_CPU_KERNELS switches them off)")
    return lib


def _packing_lib(weight: torch.Tensor, lib: ctypes.CDLL | None, what: str) -> ctypes.CDLL:
    lib = _kernels(lib, what)
    if not packed_gemm_supported(weight):
        raise ValueError(f"{what}: weight {tuple(weight.shape)} {weight.dtype} on "
                         f"{weight.device} is not a contiguous float32/bfloat16 [N, K] CPU "
                         f"tensor with K a positive multiple of 8")
    return lib


_PAIRS_FORMS = {1: "dot", 2: "widen"}


def packed_pairs_form(lib: ctypes.CDLL | None = None) -> str | None:
    """The kernel that multiplies bf16 weights packed as k pairs (`csrc/packed_gemm.h`
    `Kernel`): "dot" (`vdpbf16ps`) or "widen" (each pair widened to float32, two FMAs; the same
    bits), chosen by timing both instructions once per process (the first call measures,
    a few ms); None where the library packs no pairs (no AVX512_BF16).

    Raises:
        RuntimeError: the native kernels are unavailable.
    """
    lib = _kernels(lib, "packed_pairs_form")
    return _PAIRS_FORMS.get(lib.packed_gemm_pairs_form())


def set_packed_pairs_form(form: str, lib: ctypes.CDLL | None = None) -> None:
    """Make every later packed GEMM on bf16 pair panels in this process use `form` ("dot" or
    "widen", see `packed_pairs_form`) instead of the measured choice: for tests and
    benchmarks; call it outside a running GEMM.

    Raises:
        ValueError: `form` is not "dot" or "widen", or the library packs no pairs.
        RuntimeError: the native kernels are unavailable.
    """
    lib = _kernels(lib, "set_packed_pairs_form")
    codes = {name: code for code, name in _PAIRS_FORMS.items()}
    if form not in codes:
        raise ValueError(f"set_packed_pairs_form: form must be 'dot' or 'widen', got {form!r}")
    if lib.packed_gemm_set_pairs_form(codes[form]) != codes[form]:
        raise ValueError("set_packed_pairs_form: this kernel library packs no bf16 pairs "
                         "(built without AVX512_BF16)")


def pack_linear_weight(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`weight` [N, K] rearranged into the packed-B GEMM's panels (`csrc/packed_gemm.h`: [N/16]
    panels of [K][16] values, bf16 as [K/2][16][2] pairs where the library has AVX512_BF16, a
    tail panel for N % 16), returned as a new tensor of the same shape and dtype (only
    `packed_linear` of the same library build may read it).

    Args:
        weight: [N, K] float32 or bfloat16, contiguous, on the CPU, K % 8 == 0.
        lib: the kernel library (default `cpu_kernels()`; tests pass other builds).

    Raises:
        ValueError: an unsupported weight (see `packed_gemm_supported`).
        RuntimeError: the native kernels are unavailable.
    """
    lib = _packing_lib(weight, lib, "pack_linear_weight")
    out = torch.empty_like(weight)
    lib.pack_linear_weight(weight.data_ptr(), weight.shape[0], weight.shape[1],
                           _LINEAR_DTYPES.index(weight.dtype), out.data_ptr())
    return out


def unpack_linear_weight(packed: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The [N, K] row-major weight back from `pack_linear_weight`'s output (a new tensor).

    Raises:
        ValueError, RuntimeError: as `pack_linear_weight`.
    """
    lib = _packing_lib(packed, lib, "unpack_linear_weight")
    out = torch.empty_like(packed)
    lib.unpack_linear_weight(packed.data_ptr(), packed.shape[0], packed.shape[1],
                             _LINEAR_DTYPES.index(packed.dtype), out.data_ptr())
    return out


def packed_weight_rows(packed: torch.Tensor, ids: torch.Tensor,
                       lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows `ids` of the [N, K] weight that `pack_linear_weight` packed: an embedding lookup on
    a tied LM head's packed weight (`csrc/packed_gemm.h` `gather_rows`).

    Args:
        packed: [N, K] from `pack_linear_weight` of the same library.
        ids: [...] integer row indices in [0, N).
        lib: the kernel library (default `cpu_kernels()`).

    Returns:
        [..., K] in packed's dtype.

    Raises:
        ValueError: an unsupported weight, or ids outside [0, N).
        RuntimeError: the native kernels are unavailable.
    """
    lib = _packing_lib(packed, lib, "packed_weight_rows")
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    n, k = packed.shape
    out = torch.empty(flat.numel(), k, dtype=packed.dtype)
    if lib.packed_weight_rows(packed.data_ptr(), n, k, _LINEAR_DTYPES.index(packed.dtype),
                              flat.data_ptr(), flat.numel(), out.data_ptr()) != 0:
        raise ValueError(f"packed_weight_rows: ids outside [0, {n})")
    return out.view(*ids.shape, k)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: torch.Tensor | None = None,
                  lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y = x @ W^T + bias with the packed-B GEMM (`csrc/packed_gemm.h`), W given packed.

    Math in float32, except that with bfloat16 weights on an AVX512_BF16 build x is rounded to
    bfloat16 and multiplied as bf16 pairs with float32 accumulation (`vdpbf16ps`, or widening
    FMAs with the same bits where those are faster: `packed_pairs_form`). A bfloat16 x with a
    bfloat16 weight is read and written as bfloat16 (rounded to nearest even); other
    combinations compute on float32 x.

    Args:
        x: [..., K] float32 or bfloat16 on the CPU.
        packed_weight: [N, K] from `pack_linear_weight` of the same library.
        bias: [N] on the CPU, or None.
        lib: the kernel library (default `cpu_kernels()`).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: unsupported operands or a bias of the wrong shape (naming them).
        RuntimeError: the native kernels are unavailable.
    """
    if (lib is None and bias is None and x.dtype is torch.float32
            and packed_weight.dtype is torch.float32 and x.dim() == 2
            and packed_weight.dim() == 2 and x.shape[1] == packed_weight.shape[1]
            and x.shape[1] % 8 == 0 and x.is_cpu and packed_weight.is_cpu
            and x.is_contiguous() and packed_weight.is_contiguous()):
        # NOTE(batch-1): the float32 rows of a module-path linear, checked with a dozen cheap
        # attribute reads and called without the general path's no-op casts and views: at a
        # decode step's one row those cost several times the GEMV of a small weight (a
        # [16, 768] GEMV: 50 -> 12 us per call on a loaded host; docs/benchmarks.md).
        fast_lib = cpu_kernels()
        if fast_lib is not None:
            m, n = x.shape[0], packed_weight.shape[0]
            y = torch.empty(m, n, dtype=torch.float32)
            if m:
                k = x.shape[1]
                fast_lib.packed_linear_f32(x.data_ptr(), k, m, k, packed_weight.data_ptr(), n,
                                           None, y.data_ptr(), n)
            return y
    lib = _packing_lib(packed_weight, lib, "packed_linear")
    n, k = packed_weight.shape
    if x.device.type != "cpu" or x.dtype not in _LINEAR_DTYPES or x.dim() < 1 \
            or x.shape[-1] != k:
        raise ValueError(f"packed_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not "
                         f"fit the weight [{n}, {k}] (needs float32/bfloat16 [..., {k}] on the "
                         f"CPU)")
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        raise ValueError(f"packed_linear: bias must be a CPU tensor of shape ({n},), got "
                         f"{tuple(bias.shape)} on {bias.device}")
    b = None if bias is None else bias.to(torch.float32).contiguous()
    if x.dtype == torch.bfloat16 and packed_weight.dtype == torch.bfloat16:
        fn, act_dtype = lib.packed_linear_bf16_act, torch.bfloat16
    else:
        fn = (lib.packed_linear_f32 if packed_weight.dtype == torch.float32
              else lib.packed_linear_bf16)
        act_dtype = torch.float32
    x2 = x.reshape(-1, k).to(act_dtype)
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=act_dtype)
    if m:
        fn(x2.data_ptr(), x2.stride(0), m, k, packed_weight.data_ptr(), n,
           None if b is None else b.data_ptr(), y.data_ptr(), n)
    return y.view(*x.shape[:-1], n).to(x.dtype)


_LINEAR_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def fused_moe_supported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `cpu_fused_moe` takes these operands: CPU tensors, float32/bfloat16 hidden
    states [n, H] and contiguous stacked expert weights w13 [L, 2I, H], w2 [L, H, I] of one
    float32/bfloat16 dtype, H and I positive multiples of 8 (the AVX2 micro-kernels' step);
    whether the kernels built is `cpu_kernels()`'s business."""
    return (hidden.device.type == "cpu" and w13.device.type == "cpu"
            and w2.device.type == "cpu" and hidden.dtype in _LINEAR_DTYPE_CODES
            and w13.dtype in _LINEAR_DTYPE_CODES and w2.dtype == w13.dtype
            and hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3
            and w13.is_contiguous() and w2.is_contiguous()
            and w13.shape[2] == hidden.shape[1] == w2.shape[1] and w13.shape[0] == w2.shape[0]
            and w13.shape[1] == 2 * w2.shape[2] and hidden.shape[1] % 8 == 0
            and w2.shape[2] % 8 == 0 and hidden.shape[1] > 0 and w2.shape[2] > 0)


def cpu_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, local_ids: torch.Tensor,
                  lib: ctypes.CDLL | None = None, checked: bool = False) -> torch.Tensor:
    """The routed experts of one MoE layer in one native call (`csrc/cpu_fused_moe.cpp`):

        out[t] = sum_j topk_weights[t, j] * (silu(x W1^T) * (x W3^T)) W2^T   over the experts
                 e = local_ids[t, j] held here (0 <= e < L; others are skipped)

    Pairs are grouped by expert with a counting sort and each expert's rows run as one GEMM per
    weight tile; the k rows of a token are summed in slot order (deterministic). With bfloat16
    activations the intermediates are rounded where `fused_experts`' torch path rounds them.

    Args:
        hidden: [n, H] float32 or bfloat16 (the model dtype) on the CPU.
        w13: [L, 2I, H] (gate rows, then up rows) and w2: [L, H, I], contiguous, one dtype of
            float32/bfloat16; H and I multiples of 8 (see `fused_moe_supported`).
        topk_weights: [n, k] routing weights (read as float32).
        local_ids: [n, k] integer local expert slots; -1 or >= L (another rank's expert under
            expert parallelism) contributes nothing.
        lib: the kernel library (default `cpu_kernels()`; tests pass a portable build).
        checked: the caller already saw `fused_moe_supported(hidden, w13, w2)` hold.

    Returns:
        [n, H] in hidden's dtype.

    Raises:
        ValueError: unsupported operands (naming them) or mismatched routing shapes.
        RuntimeError: the native kernels are unavailable.
    """
    lib = _kernels(lib, "cpu_fused_moe")
    if not checked and not fused_moe_supported(hidden, w13, w2):
        raise ValueError(
            f"cpu_fused_moe does not support hidden {tuple(hidden.shape)} {hidden.dtype} with "
            f"w13 {tuple(w13.shape)} {w13.dtype} and w2 {tuple(w2.shape)} {w2.dtype} (needs "
            f"CPU tensors, float32/bfloat16, contiguous [L, 2I, H] / [L, H, I] weights of one "
            f"dtype, hidden [n, H], H and I positive multiples of 8)")
    num_tokens = hidden.shape[0]
    if (local_ids.dim() != 2 or local_ids.shape[0] != num_tokens
            or topk_weights.shape != local_ids.shape
            or local_ids.dtype.is_floating_point or local_ids.dtype == torch.bool):
        raise ValueError(f"cpu_fused_moe: local_ids {tuple(local_ids.shape)} {local_ids.dtype} "
                         f"and topk_weights {tuple(topk_weights.shape)} must both be "
                         f"[{num_tokens}, k], the ids integers")
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    x = hidden.contiguous()
    ids = local_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    rc = lib.fused_moe_experts(x.data_ptr(), _LINEAR_DTYPE_CODES[x.dtype], num_tokens,
                               x.shape[1], w13.data_ptr(), w2.data_ptr(),
                               _LINEAR_DTYPE_CODES[w13.dtype], w13.shape[0], w2.shape[2],
                               ids.data_ptr(), weights.data_ptr(), ids.shape[1], out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"fused_moe_experts failed with code {rc}")
    return out


PagedAttentionArgs = abi.struct("PagedAttentionArgs")
_CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray,
                    scale: float, causal: bool = True, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, query_tile: int | None = None,
                    lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None,
                    checked: bool = True,
                    attend_until: torch.Tensor | None = None,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention of the given requests over a KV cache with the native kernel
    (`csrc/cpu_attention.cpp`, one `PagedAttentionArgs` per call); the one wrapper of it, used
    by `CpuPagedBackend` (which writes the cache first) and the tests.

    Query token i of request r sits at position seq_lens[r] - query_len[r] + i and attends
    (causally, within the window, soft-capped) to the K/V its block table points to; with
    `attend_until` token t's causal horizon is attend_until[t] instead of its position.

    Args:
        query: [num_tokens, num_heads, head_size] float32 on the CPU (other float dtypes are
            converted).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size] float32, bfloat16, or
            int8 / float8_e4m3fn made by `kv_cache_layout.allocate_kv_cache` (with its scales).
        block_table: [num_reqs, max_blocks] int32, unit stride along a row.
        query_start_loc, seq_lens: [num_reqs + 1] / [num_reqs] int32 numpy.
        rows: [R] int32 numpy, the requests to compute (the other tokens' outputs are left
            as they are in `out`: zero in a new one).
        scale: softmax scale.
        causal, sliding_window, logits_soft_cap: as in `CpuPagedBackend.forward`.
        query_tile: query tokens per work item for requests with several query tokens (each
            K/V block is read once per tile), 4x that for requests of 16 or more, which run
            as register-blocked GEMMs on AVX2 builds for head sizes % 32 == 0 (their floats
            then differ from the per-token path's in the last bits); 1 = one token per item,
            the per-token path, where each token's floats depend on its own context alone
            (the batch-invariant mode); None = the library's default (16).
        lib: the kernel library (default `cpu_kernels()`; tests pass a portable build).
        out: [num_tokens, num_heads, head_size] float32 contiguous to write into (None: a new
            zero tensor).
        checked: validate the arguments (the backend, whose metadata builder made them,
            skips it on its per-layer calls).
        attend_until: [>= num_tokens of `rows`] int64 contiguous CPU tensor, the last key
            position each query token (flat index) may see when `causal`: at least its own
            position, below its request's seq_len (larger values are clipped to it); Gemma 3's
            image tokens see their image's last position. Ignored when not causal. None = its
            own position.

    Returns:
        `out`: [num_tokens, num_heads, head_size] float32.

    Raises:
        ValueError: an unsupported cache dtype, mismatched shapes, query_tile < 1, or an
            attend_until that is not a contiguous int64 CPU vector covering the tokens.
        RuntimeError: the native kernels are unavailable.
    """
    lib = _kernels(lib, "paged_attention")
    cache_dtype = _CACHE_DTYPE_CODES.get(kv_cache.dtype)
    if checked:
        _check_paged_attention(query, kv_cache, block_table, query_start_loc, seq_lens, rows,
                               query_tile, cache_dtype, attend_until)
    q32 = query.to(torch.float32).contiguous()
    if out is None:
        out = torch.zeros(q32.shape, dtype=torch.float32)
    args = PagedAttentionArgs(
        query=q32.data_ptr(), key_cache=kv_cache[0].data_ptr(),
        value_cache=kv_cache[1].data_ptr(), k_scale=1.0, v_scale=1.0,
        block_table=block_table.data_ptr(), block_table_stride=block_table.stride(0),
        query_start_loc=query_start_loc.ctypes.data, seq_lens=seq_lens.ctypes.data,
        attend_until=None if attend_until is None else attend_until.data_ptr(),
        rows=rows.ctypes.data, num_rows=len(rows), num_heads=query.shape[1],
        num_kv_heads=kv_cache.shape[3], head_size=query.shape[2],
        block_size=kv_cache.shape[2], causal=int(causal), window=sliding_window or 0,
        scale=scale, soft_cap=logits_soft_cap or 0.0, query_tile=query_tile or 0,
        cache_dtype=cache_dtype, out=out.data_ptr())
    if is_quantized_kv_cache(kv_cache) and scales is None:
        scales = kv_cache_scales(kv_cache)
    if kv_cache.dtype == torch.int8:
        args.k_scales, args.v_scales = scales[0].data_ptr(), scales[1].data_ptr()
    elif kv_cache.dtype == torch.float8_e4m3fn:
        args.k_scale, args.v_scale = scales.tolist()
    lib.paged_attention(ctypes.byref(args))
    return out


def _check_paged_attention(query, kv_cache, block_table, query_start_loc, seq_lens, rows,
                           query_tile, cache_dtype, attend_until) -> None:
    if query_tile is not None and query_tile < 1:
        raise ValueError(f"paged_attention: query_tile must be >= 1, got {query_tile}")
    if cache_dtype is None:
        raise ValueError(f"paged_attention: KV cache dtype {kv_cache.dtype} not supported")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or query.dim() != 3 \
            or query.shape[2] != kv_cache.shape[4] or query.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} does not fit the KV "
                         f"cache {tuple(kv_cache.shape)} (needs [T, H, D] and [2, blocks, "
                         f"block_size, KVH, D] with H a multiple of KVH)")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError(f"paged_attention: block_table must be int32 with unit row stride, "
                         f"got {block_table.dtype} strides {block_table.stride()}")
    for name, a in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("rows", rows)):
        if a.dtype != np.int32 or not a.flags.c_contiguous:
            raise ValueError(f"paged_attention: {name} must be a contiguous int32 array")
    if attend_until is not None and (
            attend_until.dtype != torch.int64 or attend_until.dim() != 1
            or attend_until.device.type != "cpu" or attend_until.stride(0) != 1
            or attend_until.shape[0] < int(query_start_loc[-1])):
        raise ValueError(f"paged_attention: attend_until must be a contiguous int64 CPU vector "
                         f"of >= {int(query_start_loc[-1])} tokens, got {attend_until.dtype} "
                         f"{tuple(attend_until.shape)} on {attend_until.device}")


class GGUFBlockType(NamedTuple):
    """A GGML block format: `code` (ggml.h's enum ggml_type), `block_weights` (weights per
    block along a row), `block_bytes` (bytes per block)."""

    code: int
    block_weights: int
    block_bytes: int


# GGML block types `gguf_linear` computes on, by name (llama.cpp's ggml-common.h).
GGUF_KERNEL_TYPES = {
    "Q8_0": GGUFBlockType(8, 32, 34), "Q4_0": GGUFBlockType(2, 32, 18),
    "Q4_1": GGUFBlockType(3, 32, 20), "Q5_0": GGUFBlockType(6, 32, 22),
    "Q5_1": GGUFBlockType(7, 32, 24), "Q4_K": GGUFBlockType(12, 256, 144),
    "Q5_K": GGUFBlockType(13, 256, 176), "Q6_K": GGUFBlockType(14, 256, 210)}
GGUF_BLOCK_SIZE = 32  # the smallest block: an input split must fall on its multiples at least


GGUF_GROUP_ROWS = 4  # rows per group of the row-group layout (csrc/gguf_blocks.h kGroupRows)


# Rows [row_start, row_start + rows) of a weight, stored at `data` as rows * row_bytes bytes of
# blocks of type `ggml_type`, plain rows or (`grouped` 1) in the row-group layout
# (`gguf_group_rows`).
GGUFSegmentStruct = abi.struct("GGUFSegment")


def gguf_group_rows(qweight: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """A GGUF weight's plain rows in the row-group layout of the block kernels
    (csrc/gguf_blocks.h, after llama.cpp's load-time repacking): each group of GGUF_GROUP_ROWS
    consecutive rows stores block 0 of its rows, then block 1, and so on (Q8_0, Q4_0, Q4_1,
    Q4_K, Q5_K: each such block set as one record whose quant bytes alternate between the rows every
    4 bytes), so a kernel reading a group's rows side by side reads memory sequentially; the last
    rows % GGUF_GROUP_ROWS rows stay plain. The bytes are the same, reordered.

    Args:
        qweight: [rows, row_bytes] uint8 plain rows of `tensor_type` blocks.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES.

    Returns:
        A new [rows, row_bytes] uint8 tensor (row n's bytes are no longer row n of it).

    Raises:
        ValueError: not a [rows, row_bytes] uint8 CPU tensor, or a type without kernels.
        RuntimeError: the native kernels are unavailable.
    """
    return _permute_groups(qweight, tensor_type, inverse=False)


def gguf_ungroup_rows(qweight: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """The inverse of `gguf_group_rows` (same arguments and errors): [rows, row_bytes] uint8 in
    the row-group layout -> a new tensor of the plain rows."""
    return _permute_groups(qweight, tensor_type, inverse=True)


def _permute_groups(qweight: torch.Tensor, tensor_type: str, inverse: bool) -> torch.Tensor:
    """`gguf_group_rows` (or its inverse) natively (`gguf_regroup_rows`,
    csrc/cpu_gguf_linear.cpp): several times faster than torch's byte-strided copies
    (docs/benchmarks.md, "Measurements behind choices in the code")."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.device.type != "cpu":
        raise ValueError(f"gguf_group_rows: a [rows, row_bytes] uint8 CPU tensor is needed, got "
                         f"{tuple(qweight.shape)} {qweight.dtype} on {qweight.device}")
    rows, row_bytes = qweight.shape
    block = GGUF_KERNEL_TYPES.get(tensor_type)
    if block is None or row_bytes % block.block_bytes:
        raise ValueError(f"gguf_group_rows: {tensor_type} rows of {row_bytes} bytes are not "
                         f"whole blocks of a kernel type ({', '.join(GGUF_KERNEL_TYPES)})")
    lib = _kernels(None, "gguf_group_rows")
    src = qweight.contiguous()
    out = src.clone()                # the rows past the last whole group stay plain
    lib.gguf_regroup_rows(src.data_ptr(), out.data_ptr(), rows, row_bytes, block.code,
                          int(inverse))
    return out


def gguf_segment_structs(segments: Sequence[tuple], k: int) -> ctypes.Array:
    """The native description of a weight's row segments, checked against input size `k`.

    Args:
        segments: (row_start, GGML type name, qweight [rows, k / block_weights * block_bytes]
            uint8 contiguous CPU tensor[, grouped]) per segment, `grouped` (default False)
            telling that qweight is in the row-group layout (`gguf_group_rows`); the caller
            keeps the tensors alive while the structures are in use.
        k: the input size (a multiple of each type's block_weights).

    Raises:
        ValueError: an unsupported type, or a qweight / k that does not fit it (naming both).
    """
    structs = (GGUFSegmentStruct * len(segments))()
    for struct, (row_start, tensor_type, qweight, *grouped) in zip(structs, segments):
        if tensor_type not in GGUF_KERNEL_TYPES:
            raise ValueError(f"gguf_linear: tensor type {tensor_type} not supported; supported: "
                             f"{', '.join(GGUF_KERNEL_TYPES)}")
        code, block_weights, block_bytes = GGUF_KERNEL_TYPES[tensor_type]
        if (qweight.device.type != "cpu" or qweight.dtype != torch.uint8 or qweight.dim() != 2
                or not qweight.is_contiguous() or k % block_weights
                or qweight.shape[1] != k // block_weights * block_bytes):
            raise ValueError(
                f"gguf_linear: an input size of {k} does not fit the {tensor_type} weight "
                f"{tuple(qweight.shape)} {qweight.dtype} on {qweight.device} (needs a "
                f"contiguous uint8 CPU weight of K / {block_weights} * {block_bytes} bytes per "
                f"row, K a multiple of {block_weights})")
        struct.data, struct.row_start = qweight.data_ptr(), row_start
        struct.rows, struct.ggml_type = qweight.shape[0], code
        struct.grouped = int(bool(grouped and grouped[0]))
    return structs


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, tensor_type: str,
                bias: torch.Tensor | None = None, quantize_activations: bool = False,
                grouped: bool = False) -> torch.Tensor:
    """y = x @ dequantize(qweight)^T + bias with the weight kept in its GGML block format; each
    block is unpacked in registers inside the dot product (`csrc/cpu_gguf_linear.cpp`, as in
    llama.cpp's ggml), activations and sums in float32.

    Args:
        x: [..., K] float32/bfloat16/float16 on the CPU (computed in float32); K a multiple of
            the type's block_weights (32, or 256 for the K-quants).
        qweight: [N, K / block_weights * block_bytes] uint8, contiguous: each row its
            consecutive blocks, as a GGUF file stores them.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES ("Q8_0", "Q4_K", ...).
        bias: [N] on the CPU, or None.
        quantize_activations: first round x to 8 bits per 32-value block, or per 256 for the
            K-quants (see `gguf_quantize_activations`), and compute integer dot products per
            block (`csrc/gguf_q8_dot.h`, llama.cpp's `ggml_vec_dot_<type>_q8_0` / `_q8_K`
            schemes): equal to x_q @ dequantize(W)^T, x_q the rounded x, up to the order of the
            float32 sums; every type in GGUF_KERNEL_TYPES. The layers' choice:
            `GGUFLinearMethod`.
        grouped: qweight is in the row-group layout (`gguf_group_rows`).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: an unsupported type, shapes or dtypes that do not fit, non-CPU tensors.
        RuntimeError: the native kernels are unavailable (see `pagedllm.native.kernels.cpu_kernels`).
    """
    return gguf_linear_segments(x, [(0, tensor_type, qweight, grouped)], qweight.shape[0], bias,
                                quantize_activations)


def gguf_linear_segments(x: torch.Tensor, segments: Sequence[tuple], n: int,
                         bias: torch.Tensor | None = None,
                         quantize_activations: bool = False) -> torch.Tensor:
    """`gguf_linear` for a weight of N rows stored as row segments, each in its own GGML type
    (a fused qkv or gate_up weight of a Q4_K_M file), in one native call.

    Args:
        x: [..., K] floating, on the CPU.
        segments: (row_start, type name, qweight [rows, row_bytes] uint8[, grouped]) covering
            rows [0, n) exactly once, in any order (see `gguf_segment_structs`).
        n: the output size N.
        bias: [N] on the CPU, or None.
        quantize_activations: see `gguf_linear` (x is rounded once for all segments).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: as `gguf_linear`, or segments that do not cover [0, n) exactly once.
        RuntimeError: the native kernels are unavailable.
    """
    k = x.shape[-1]
    if x.device.type != "cpu" or not x.dtype.is_floating_point:
        raise ValueError(f"gguf_linear: x {tuple(x.shape)} {x.dtype} on {x.device} must be a "
                         f"floating CPU tensor")
    if k % GGUF_BLOCK_SIZE:
        raise ValueError(f"gguf_linear: K = {k} is not a multiple of {GGUF_BLOCK_SIZE}")
    structs = gguf_segment_structs(segments, k)
    covered = sorted((s.row_start, s.row_start + s.rows) for s in structs)
    if [b for _, b in covered[:-1]] != [a for a, _ in covered[1:]] or \
            (covered[0][0], covered[-1][1]) != (0, n):
        raise ValueError(f"gguf_linear: segments {covered} do not cover the rows [0, {n}) "
                         f"exactly once")
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        raise ValueError(f"gguf_linear: bias must be a CPU tensor of shape ({n},), got "
                         f"{tuple(bias.shape)} on {bias.device}")
    lib = _kernels(None, "gguf_linear")
    x2 = x.reshape(-1, k).to(torch.float32)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    b_ptr = None if b is None else b.data_ptr()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    fn = lib.linear_gguf_segments_q8 if quantize_activations else lib.linear_gguf_segments
    rc = fn(x2.data_ptr(), x2.stride(0), x2.shape[0], k, structs, len(structs), b_ptr,
            y.data_ptr(), n)
    if rc != 0:
        raise RuntimeError(f"gguf_linear: the native kernel refused the segment types "
                           f"{[s[1] for s in segments]}")
    return y.view(*x.shape[:-1], n).to(x.dtype)


def gguf_quantize_activations(x: torch.Tensor, lib: ctypes.CDLL | None = None, block: int = 32
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rounding of x in `gguf_linear(..., quantize_activations=True)`, alone (natively):
    per block b of `block` values of a row, d[b] = max|x_b| / 127, q = round(x_b * (1 / d[b]))
    half to even (0 for an all-zero block), in float32.
    block=32 (the 32-value types; llama.cpp's `quantize_row_q8_0` plus its q8_1 sum): the third
    result is ds[b] = d[b] * sum(q_b).
    block=256 (the K-quants; llama.cpp's q8_K, symmetric): the third result is bsums, the int16
    sums of q per 16 values.

    Args:
        x: [M, K] float32 on the CPU, K a positive multiple of `block`.
        lib: the kernel library (default `cpu_kernels()`; tests pass other builds).
        block: 32 or 256.

    Returns:
        block=32: (q [M, K] int8, d [M, K / 32] float32, ds [M, K / 32] float32);
        block=256: (q [M, K] int8, d [M, K / 256] float32, bsums [M, K / 16] int16).

    Raises:
        ValueError: x not a 2-D float32 CPU tensor with K a positive multiple of `block`, or
            another block size.
        RuntimeError: the native kernels are unavailable.
    """
    if block not in (32, 256):
        raise ValueError(f"gguf_quantize_activations: block must be 32 or 256, got {block}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" \
            or x.shape[1] == 0 or x.shape[1] % block:
        raise ValueError(f"gguf_quantize_activations: x must be [M, K] float32 on the CPU with "
                         f"K a positive multiple of {block}, got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")
    lib = _kernels(lib, "gguf_quantize_activations")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // block, dtype=torch.float32)
    if block == 32:
        third = torch.empty_like(d)
        fn = lib.quantize_rows_gguf_q8
    else:
        third = torch.empty(m, k // 16, dtype=torch.int16)
        fn = lib.quantize_rows_gguf_q8k
    fn(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr(), third.data_ptr())
    return q, d, third


def gguf_dequantize_rows(qweight: torch.Tensor, tensor_type: str, ids: torch.Tensor,
                         k: int, grouped: bool = False) -> torch.Tensor:
    """The rows `ids` of a GGUF-block weight, dequantized (an embedding lookup on a quantized
    token embedding; `csrc/cpu_gguf_linear.cpp`, the unpacking of `gguf_linear`).

    Args:
        qweight: [rows, k / block_weights * block_bytes] uint8, contiguous, on the CPU.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES.
        ids: [...] integer row indices in [0, rows).
        k: the row length in weights.
        grouped: qweight is in the row-group layout (`gguf_group_rows`).

    Returns:
        [..., k] float32.

    Raises:
        ValueError: an unsupported type, a weight that does not fit, or ids out of range.
        RuntimeError: the native kernels are unavailable.
    """
    structs = gguf_segment_structs([(0, tensor_type, qweight, grouped)], k)
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    lib = _kernels(None, "gguf_dequantize_rows")
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    rc = lib.dequantize_rows_gguf(structs, k, flat.data_ptr(), flat.numel(), out.data_ptr())
    if rc == -2:   # (checked natively: a lookup per step, where two torch reductions cost more)
        raise ValueError(f"gguf_dequantize_rows: ids outside [0, {qweight.shape[0]})")
    if rc != 0:
        raise ValueError(f"gguf_dequantize_rows: tensor type {tensor_type} not supported")
    return out.view(*ids.shape, k)


def _check_int8_operands(name: str, x: torch.Tensor, qweight: torch.Tensor,
                         scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    n, k = qweight.shape if qweight.dim() == 2 else (None, None)
    if (qweight.dtype != torch.int8 or qweight.dim() != 2 or not qweight.is_contiguous()
            or k == 0 or qweight.device.type != "cpu"):
        raise ValueError(f"{name}: qweight must be a contiguous [N, K] int8 CPU tensor with "
                         f"K > 0, got {tuple(qweight.shape)} {qweight.dtype} on "
                         f"{qweight.device}")
    if x.device.type != "cpu" or not x.dtype.is_floating_point or x.dim() < 1 \
            or x.shape[-1] != k:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} on {x.device} must be a "
                         f"floating CPU tensor [..., {k}]")
    if scale.shape != (n,) or scale.dtype != torch.float32 or scale.device.type != "cpu" \
            or not scale.is_contiguous():
        raise ValueError(f"{name}: scale must be a contiguous float32 CPU tensor of shape "
                         f"({n},), got {tuple(scale.shape)} {scale.dtype} on {scale.device}")
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        raise ValueError(f"{name}: bias must be a CPU tensor of shape ({n},), got "
                         f"{tuple(bias.shape)} on {bias.device}")


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None,
                quantize_activations: bool = False) -> torch.Tensor:
    """y = (x @ qweight^T) * scale + bias with a per-output-channel int8 weight
    (`csrc/cpu_int8_linear.cpp`).

    Weight-only (the default): int8 weights widened to float32 in registers, activations and
    sums in float32; equal to x @ (qweight * scale[:, None])^T up to the order of the sums.
    With `quantize_activations` (W8A8): each row (token) t of x is first rounded to int8,
    xs[t] = max|x[t, :]| / 127, xq = round(x / xs) (half to even) in [-127, 127]; int8 x int8
    products are summed exactly in int32 and y = acc * xs[t] * scale + bias
    (`quantize_per_token_int8` gives xq and xs alone).

    Args:
        x: [..., K] float32/bfloat16/float16 on the CPU (computed in float32).
        qweight: [N, K] int8, contiguous, on the CPU; any K >= 1.
        scale: [N] float32, contiguous: row n of the weight is scale[n] * qweight[n].
        bias: [N] on the CPU, or None.
        quantize_activations: W8A8 instead of weight-only (see above).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (naming them).
        RuntimeError: the native kernels are unavailable (see `pagedllm.native.kernels.cpu_kernels`).
    """
    _check_int8_operands("int8_linear", x, qweight, scale, bias)
    lib = _kernels(None, "int8_linear")
    n, k = qweight.shape
    x2 = x.reshape(-1, k).to(torch.float32)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    fn = lib.linear_w8a8_f32 if quantize_activations else lib.linear_int8_f32
    fn(x2.data_ptr(), x2.stride(0), x2.shape[0], k, qweight.data_ptr(), n, scale.data_ptr(),
       None if b is None else b.data_ptr(), y.data_ptr(), n)
    return y.view(*x.shape[:-1], n).to(x.dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token activation quantization of `int8_linear(..., quantize_activations=True)`,
    natively: xs[t] = max|x[t, :]| / 127 (0 for a zero row), xq = round(x / xs) half to even,
    clamped to [-127, 127].

    Args:
        x: [M, K] float32 on the CPU, K >= 1.

    Returns:
        (xq [M, K] int8, xs [M] float32).

    Raises:
        ValueError: x not a 2-D float32 CPU tensor.
        RuntimeError: the native kernels are unavailable.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0:
        raise ValueError(f"quantize_per_token_int8: x must be [M, K>0] float32 on the CPU, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    lib = _kernels(None, "quantize_per_token_int8")
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty(x.shape, dtype=torch.int8)
    xs = torch.empty(x.shape[0], dtype=torch.float32)
    lib.quantize_rows_int8(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], xq.data_ptr(),
                           xs.data_ptr())
    return xq, xs


def mla_expanded_prefill_supported(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the kernel library has `mla_expanded_prefill` (AVX-512 builds); False without
    the native kernels."""
    lib = lib if lib is not None else cpu_kernels()
    return lib is not None and bool(lib.mla_expanded_prefill_supported())


def mla_expanded_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_nope: torch.Tensor,
                         k_pe: torch.Tensor, ctx_start: np.ndarray, query_start_loc: np.ndarray,
                         seq_lens: np.ndarray, rows: np.ndarray, scale: float, query_tile: int,
                         out: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """MLA attention in the expanded form (`csrc/cpu_mla_prefill.cpp`): query token i of
    request r (position seq_lens[r] - query_len[r] + i) attends causally to its context
    positions c, whose key for head h is [kv_nope[ctx_start[r] + c, h, :dn] | k_pe[ctx_start[r]
    + c]] and value kv_nope[ctx_start[r] + c, h, dn:]. Arguments are not validated (the MLA
    backend makes them); unsupported builds are refused.

    Args:
        q_nope: [num_tokens, H, dn]; q_pe: [num_tokens, H, dr]; float32 or bfloat16, unit
            stride along the last dimension (token and head strides are passed).
        kv_nope: [num_ctx, H, dn + dv] contiguous, q_nope's dtype: c_kv expanded by kv_b_proj.
        k_pe: [num_ctx, dr] q_nope's dtype, unit stride along a row (rows may be strided).
        ctx_start: [num_reqs] int64 numpy; query_start_loc, seq_lens: [num_reqs + 1] /
            [num_reqs] int32 numpy; rows: [R] int32 numpy, the requests to compute.
        scale: softmax scale.
        query_tile: query tokens per work item (16 per vector of lanes).
        out: [num_tokens, H, dv] float32 contiguous; the rows' tokens are written.

    Returns:
        `out`.

    Raises:
        RuntimeError: the kernels are unavailable or lack the kernel, or it refused the sizes.
    """
    lib = _kernels(lib, "mla_expanded_prefill")
    dtype = {torch.float32: 0, torch.bfloat16: 1}.get(q_nope.dtype, -1)
    if q_nope.stride(2) != 1:
        q_nope = q_nope.contiguous()
    if q_pe.stride(2) != 1:
        q_pe = q_pe.contiguous()
    args = abi.struct("MLAExpandedPrefillArgs")(
        q_nope=q_nope.data_ptr(), q_pe=q_pe.data_ptr(),
        q_nope_strides=(ctypes.c_int64 * 2)(q_nope.stride(0), q_nope.stride(1)),
        q_pe_strides=(ctypes.c_int64 * 2)(q_pe.stride(0), q_pe.stride(1)),
        kv_nope=kv_nope.data_ptr(),
        k_pe=k_pe.data_ptr(), k_pe_stride=k_pe.stride(0), ctx_start=ctx_start.ctypes.data,
        query_start_loc=query_start_loc.ctypes.data, seq_lens=seq_lens.ctypes.data,
        rows=rows.ctypes.data, num_rows=len(rows), num_heads=q_nope.shape[1],
        nope_size=q_nope.shape[2], rope_size=q_pe.shape[2],
        v_size=kv_nope.shape[2] - q_nope.shape[2], query_tile=query_tile, dtype=dtype,
        scale=scale, out=out.data_ptr())
    code = lib.mla_expanded_prefill(ctypes.byref(args))
    if code != 0:
        raise RuntimeError(f"mla_expanded_prefill failed with code {code} (-1: bad sizes or "
                           f"dtype {q_nope.dtype}, -2: not in this build)")
    return out
