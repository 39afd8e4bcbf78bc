"""Python entry points of the native CPU attention kernels: paged attention over a KV cache
(`csrc/cpu_attention.cpp`) and MLA's expanded-form prefill (`csrc/cpu_mla_prefill.cpp`)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagedllm.kv_cache_layout import is_quantized_kv_cache, kv_cache_scales
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.native.kernels.ops import require_kernels

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
    lib = require_kernels(lib, "paged_attention")
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
    lib = require_kernels(lib, "mla_expanded_prefill")
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
