"""Python entry points of the DSA decode kernels (`csrc/cpu_dsa.cpp`): the lightning indexer's
scores and top-k over the paged indexer cache, and sparse MLA (absorbed form) over the selected
latents. The formulas are in `attention/backends/dsa_torch.py` (the torch reference ops these
are tested against) and in the header of `csrc/cpu_dsa.cpp`.

Both take decode rows only (one query token per request); positions are context positions of
the request (0 .. seq_len - 1), located in the caches through the block table.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagedllm.native.kernels import abi, cpu_kernels

DSAIndexerArgs = abi.struct("DSAIndexerArgs")
SparseMLADecodeArgs = abi.struct("SparseMLADecodeArgs")

_CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2,
                      torch.float8_e4m3fn: 3}
_LATENT_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _library(lib: ctypes.CDLL | None, what: str) -> ctypes.CDLL:
    lib = lib if lib is not None else cpu_kernels()
    if lib is None:
        raise RuntimeError(f"{what} needs the native CPU kernels, which are unavailable (see "
                           f"the log; PAGEDLLM_CPU_KERNELS switches them off)")
    return lib


def _check_table(block_table: torch.Tensor, seq_lens: np.ndarray, rows: np.ndarray,
                 block_size: int, num_slots: int, what: str) -> None:
    """Raise ValueError unless every row's context fits its block table and the cache."""
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError(f"{what}: block_table must be int32 with unit row stride, got "
                         f"{block_table.dtype} strides {block_table.stride()}")
    if seq_lens.dtype != np.int32 or rows.dtype != np.int32:
        raise ValueError(f"{what}: seq_lens and rows must be int32 numpy arrays")
    if len(rows) and (rows.min() < 0 or rows.max() >= min(len(seq_lens),
                                                          block_table.shape[0])):
        raise ValueError(f"{what}: a row outside the {len(seq_lens)} requests")
    for r in rows:
        n_blocks = -(-int(seq_lens[r]) // block_size)
        if n_blocks > block_table.shape[1] or (
                n_blocks and int(block_table[r, :n_blocks].max()) * block_size >= num_slots):
            raise ValueError(f"{what}: request {r}'s context of {seq_lens[r]} tokens is not "
                             f"covered by its block table / the cache")


def dsa_indexer_topk(q: torch.Tensor, weights: torch.Tensor, indexer_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: np.ndarray, rows: np.ndarray,
                     tokens: np.ndarray, topk: int, scale: float,
                     lib: ctypes.CDLL | None = None, checked: bool = True) -> torch.Tensor:
    """Each decode row's `topk` context positions of largest lightning-indexer score.

    Row i is request rows[i]'s query token tokens[i], at position seq_lens[rows[i]] - 1; it
    scores positions 0 .. seq_len - 1 (causal) as `dsa_torch.indexer_scores` (float32, scale
    D^-0.5, the C8 per-token scales applied in-kernel) and keeps the topk largest. With
    seq_len <= topk every position is selected and nothing is scored.

    Args:
        q: [num_tokens, Hi, D] indexer queries (RoPE and, for a C8 cache, the Hadamard
            rotation applied); converted to contiguous float32.
        weights: [num_tokens, Hi] head weights (Hi^-0.5 included); float32.
        indexer_cache: one layer's indexer cache (`indexer_cache_layout.allocate_indexer_cache`:
            float32 / bfloat16 rows of D, or int8 / fp8 e4m3 rows of D + 4 with the scale).
        block_table: [num_reqs, max_blocks] int32, unit stride along a row.
        seq_lens: [num_reqs] int32 numpy, context lengths including the query.
        rows: [R] int32 numpy, the decode rows' requests; tokens: [R] int64 numpy, their query
            tokens (indices into q).
        topk: index_topk (>= 1); scale: D^-0.5.
        lib: the kernel library (default `cpu_kernels()`).
        checked: validate the arguments (the backend skips it per layer).

    Returns:
        [R, topk] int64 positions, increasing within a row, -1 padded (where seq_len < topk).
        Among equal scores the earlier position is kept.

    Raises:
        ValueError: a cache dtype without a kernel, mismatched shapes, a bad topk, or rows
            whose context the block table or cache does not cover.
        RuntimeError: the native kernels are unavailable.
    """
    lib = _library(lib, "dsa_indexer_topk")
    cache_dtype = _CACHE_DTYPE_CODES.get(indexer_cache.dtype)
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    num_tokens, n_heads, head_dim = q.shape
    if checked:
        if cache_dtype is None:
            raise ValueError(f"dsa_indexer_topk: no kernel for an indexer cache of "
                             f"{indexer_cache.dtype}")
        row = head_dim + 4 if cache_dtype >= 2 else head_dim
        if indexer_cache.shape[-1] != row or not indexer_cache.is_contiguous():
            raise ValueError(f"dsa_indexer_topk: indexer cache rows of {indexer_cache.shape[-1]}"
                             f" values for index_head_dim {head_dim} (expected {row}, "
                             f"contiguous)")
        if tuple(weights.shape) != (num_tokens, n_heads) or topk < 1:
            raise ValueError(f"dsa_indexer_topk: weights {tuple(weights.shape)} for q "
                             f"{tuple(q.shape)}, topk {topk}")
        if len(tokens) != len(rows) or (len(tokens) and not 0 <= tokens.min()
                                        <= tokens.max() < num_tokens):
            raise ValueError("dsa_indexer_topk: tokens must give one query token per row, "
                             f"within the {num_tokens} tokens")
        _check_table(block_table, seq_lens, rows, indexer_cache.shape[2],
                     indexer_cache.shape[1] * indexer_cache.shape[2], "dsa_indexer_topk")
    q32 = q.to(torch.float32).contiguous()
    w32 = weights.to(torch.float32).contiguous()
    out = torch.empty(len(rows), topk, dtype=torch.int64)
    args = DSAIndexerArgs(
        q=q32.data_ptr(), weights=w32.data_ptr(), k_cache=indexer_cache.data_ptr(),
        block_table=block_table.data_ptr(), block_table_stride=block_table.stride(0),
        seq_lens=seq_lens.ctypes.data, rows=rows.ctypes.data, tokens=tokens.ctypes.data,
        num_rows=len(rows), n_heads=n_heads, head_dim=head_dim,
        block_size=indexer_cache.shape[2], topk=topk, cache_dtype=cache_dtype, scale=scale,
        out=out.data_ptr())
    if lib.dsa_indexer_topk(ctypes.addressof(args)) != 0:
        raise ValueError("dsa_indexer_topk: the kernel refused its arguments")
    return out


def dsa_sparse_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: np.ndarray, rows: np.ndarray, positions: torch.Tensor,
                          kv_lora_rank: int, scale: float, lib: ctypes.CDLL | None = None,
                          checked: bool = True) -> torch.Tensor:
    """Sparse MLA decode in the absorbed form: each row's H heads over its selected latents.

    out[i, h] = sum_j softmax_j(scale * q[i, h] . c_j) * c_j[:kv_lora_rank] over the latents c_j
    at positions[i, j] >= 0 of request rows[i] (as `dsa_torch.sparse_mla_absorbed` before W_UV).

    Args:
        q: [R, H, L + dr] absorbed queries [W_UK^T q_nope | q_pe]; converted to float32.
        latent_cache: one MLA layer's cache [1, num_blocks, block_size, 1, L + dr] float32 or
            bfloat16.
        block_table, seq_lens, rows: as `dsa_indexer_topk`.
        positions: [R, K] int64 context positions (below each row's seq_len), -1 = none.
        kv_lora_rank: L; scale: the softmax scale.
        lib, checked: as `dsa_indexer_topk`.

    Returns:
        [R, H, L] float32.

    Raises:
        ValueError: a latent dtype without a kernel, mismatched shapes, positions past a row's
            context, or a context the block table or cache does not cover.
        RuntimeError: the native kernels are unavailable.
    """
    lib = _library(lib, "dsa_sparse_mla_decode")
    cache_dtype = _LATENT_DTYPE_CODES.get(latent_cache.dtype)
    num_rows, num_heads, latent_size = q.shape
    positions = positions.to(torch.int64).contiguous()
    if checked:
        if cache_dtype is None or not latent_cache.is_contiguous():
            raise ValueError(f"dsa_sparse_mla_decode: no kernel for a {latent_cache.dtype} "
                             f"latent cache (float32 / bfloat16, contiguous)")
        if latent_cache.shape[-1] != latent_size or not 0 < kv_lora_rank <= latent_size:
            raise ValueError(f"dsa_sparse_mla_decode: q {tuple(q.shape)}, latent cache rows of "
                             f"{latent_cache.shape[-1]}, kv_lora_rank {kv_lora_rank}")
        if positions.shape[0] != num_rows or len(rows) != num_rows:
            raise ValueError(f"dsa_sparse_mla_decode: positions {tuple(positions.shape)} and "
                             f"{len(rows)} rows for {num_rows} queries")
        _check_table(block_table, seq_lens, rows, latent_cache.shape[2],
                     latent_cache.shape[1] * latent_cache.shape[2], "dsa_sparse_mla_decode")
        limit = torch.from_numpy(seq_lens[rows].astype(np.int64))[:, None]
        if bool((positions >= limit).any()):
            raise ValueError("dsa_sparse_mla_decode: a position past its row's context")
    q32 = q.to(torch.float32).contiguous()
    out = torch.empty(num_rows, num_heads, kv_lora_rank, dtype=torch.float32)
    args = SparseMLADecodeArgs(
        q=q32.data_ptr(), latent_cache=latent_cache.data_ptr(),
        block_table=block_table.data_ptr(), block_table_stride=block_table.stride(0),
        rows=rows.ctypes.data, positions=positions.data_ptr(), num_rows=num_rows,
        num_heads=num_heads, latent_size=latent_size, kv_lora_rank=kv_lora_rank,
        block_size=latent_cache.shape[2], topk=positions.shape[1], cache_dtype=cache_dtype,
        scale=scale, out=out.data_ptr())
    if lib.dsa_sparse_mla_decode(ctypes.addressof(args)) != 0:
        raise ValueError("dsa_sparse_mla_decode: the kernel refused its arguments")
    return out
