"""mla_prefill: Multi-head Latent Attention over the paged latent cache for chunks of several query
tokens (prefill / extend, a cached prefix included), in the absorbed form (Triton).

As `triton_mla_decode` (which has the form and the cache layout), for every query token of a
chunk: score[t, h, s] = scale * (q_lat[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s]) over the
request's positions s <= the token's own position (causal within the chunk, the whole cached
prefix visible), o_lat[t, h] = softmax_s(score[t, h, :]) c_kv. W_UK is folded into q_lat and
W_UV applied to o_lat outside the kernel.

One launch, grid (query tiles, head blocks). A query tile is BLOCK_Q consecutive tokens of one
request (host-made: `plan_query_tiles`); a program takes BLOCK_H heads of its tile, and its
BLOCK_Q x BLOCK_H (token, head) pairs are the rows of its tiles (row m: token m // BLOCK_H, head
m % BLOCK_H), so each latent tile [TILE_SIZE, L + dr] is loaded once for all the heads and all
the query tokens of the program: FlashAttention-2's query-block loop (Dao 2023, Algorithm 1,
online softmax), with MLA's latent shared by the heads as the extra reuse axis (vLLM's Triton
MLA decode groups heads the same way; there a program has one token). The program walks the
positions [0, last position of its tile] in tiles of TILE_SIZE through the block table, masking
each row's positions past its own. No split-K: a chunk has as many programs as tiles.

Quantized latent caches are read as stored, as in `triton_mla_decode`: int8's per-token scale
multiplies that column's scores and probabilities, fp8's per-tensor scale likewise. Dots in
the query dtype with fp32 accumulation (IEEE for fp32).

NOTE(gpu): written and tested under triton's interpreter only (no GPU where this was built):
BLOCK_Q / BLOCK_H, the tile size and the warp count are untuned guesses, and the compiled
path is unchecked.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from triton.runtime.interpreter import InterpretedFunction

from pagedllm.attention.ops.triton_mla_decode import check_latent_inputs, dot_dtype_for
from pagedllm.attention.ops.triton_unified_attention import _MIN_DOT_SIZE

# (token, head) rows per program: BLOCK_Q tokens x BLOCK_H heads (BLOCK_H = all heads up to 64).
DEFAULT_BLOCK_M = 64
MAX_BLOCK_H = 64
_TILE_SIZE = 16


@triton.jit
def _mla_prefill_kernel(
    out_ptr, q_lat_ptr, q_pe_ptr, cache_ptr, scales_ptr, block_table_ptr,
    tile_req_ptr, tile_row_ptr, tile_pos_ptr, tile_len_ptr,
    scale, num_heads,
    stride_ql_row, stride_ql_head, stride_qp_row, stride_qp_head, stride_o_row, stride_o_head,
    stride_c_blk, stride_c_slot, stride_bt_row,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    L_PADDED: tl.constexpr, R_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr, QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    head_block = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile_id).to(tl.int64)
    row0 = tl.load(tile_row_ptr + tile_id).to(tl.int64)     # the tile's first query row
    pos0 = tl.load(tile_pos_ptr + tile_id)                  # its position in the request
    n_tok = tl.load(tile_len_ptr + tile_id)

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = offs_m // BLOCK_H
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    m_valid = (tok < n_tok) & (head < num_heads)
    q_pos = pos0 + tok                                       # [M] each row's position
    offs_l = tl.arange(0, L_PADDED)
    offs_r = tl.arange(0, R_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    l_valid = offs_l < KV_LORA_RANK
    r_valid = offs_r < ROPE_DIM

    q_row = (row0 + tok).to(tl.int64)
    q_lat = tl.load(q_lat_ptr + q_row[:, None] * stride_ql_row + head[:, None] * stride_ql_head
                    + offs_l[None, :], mask=m_valid[:, None] & l_valid[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + q_row[:, None] * stride_qp_row + head[:, None] * stride_qp_head
                   + offs_r[None, :], mask=m_valid[:, None] & r_valid[None, :], other=0.0)
    q_lat = q_lat.to(DOT_DTYPE)
    q_pe = q_pe.to(DOT_DTYPE)
    tensor_scale = 1.0
    if QUANT == 2:
        tensor_scale = tl.load(scales_ptr)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, L_PADDED], dtype=tl.float32)
    bt_row = block_table_ptr + req * stride_bt_row
    kv_hi = pos0 + n_tok                                     # positions [0, kv_hi) are read

    for tile in range(0, tl.cdiv(kv_hi, TILE_SIZE)):
        k_pos = tile * TILE_SIZE + offs_t                                  # [TILE]
        k_valid = k_pos < kv_hi
        block_id = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot_in_block = (k_pos % BLOCK_SIZE).to(tl.int64)
        row_ptr = cache_ptr + block_id * stride_c_blk + slot_in_block * stride_c_slot
        c_kv = tl.load(row_ptr[:, None] + offs_l[None, :],
                       mask=k_valid[:, None] & l_valid[None, :], other=0.0)        # [TILE, L]
        k_pe = tl.load(row_ptr[:, None] + KV_LORA_RANK + offs_r[None, :],
                       mask=k_valid[:, None] & r_valid[None, :], other=0.0)       # [TILE, dr]
        if QUANT != 0:
            c_kv = c_kv.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        # NOTE(perf): dots inline, not in a jitted helper (see triton_mla_decode).
        s = (tl.dot(q_lat, tl.trans(c_kv).to(DOT_DTYPE), input_precision=DOT_PRECISION)
             + tl.dot(q_pe, tl.trans(k_pe).to(DOT_DTYPE), input_precision=DOT_PRECISION))
        if QUANT == 1:
            token_scale = tl.load(scales_ptr + block_id * BLOCK_SIZE + slot_in_block,
                                  mask=k_valid, other=0.0)
            s = s * token_scale[None, :]
        elif QUANT == 2:
            s = s * tensor_scale
        allowed = m_valid[:, None] & k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s * scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: rows with nothing allowed yet (padding rows) keep m = -inf; subtracting 0
        # keeps exp() at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT == 1:
            p = p * token_scale[None, :]
        elif QUANT == 2:
            p = p * tensor_scale
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c_kv.to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(out_ptr + q_row[:, None] * stride_o_row + head[:, None] * stride_o_head
             + offs_l[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=m_valid[:, None] & l_valid[None, :])


# Whether this module's kernel was decorated for triton's interpreter (TRITON_INTERPRET=1 at
# import; it then runs on CPU tensors).
INTERPRETED: bool = isinstance(_mla_prefill_kernel, InterpretedFunction)


def query_block(num_heads: int, block_m: int = DEFAULT_BLOCK_M) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_H) for `num_heads` heads: all heads in one block up to MAX_BLOCK_H
    (padded to a power of two), and as many tokens as fill `block_m` rows (at least one)."""
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(num_heads))
    return max(1, block_m // block_h), block_h


def plan_query_tiles(query_start_loc: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray,
                     block_q: int) -> np.ndarray:
    """The query tiles of requests `rows`: [4, num_tiles] int32 = (request, first query row,
    first token's position, tokens), the query rows numbered over the rows' tokens in order
    (row i's tokens first, then row i + 1's: the order `mla_prefill`'s queries come in).

    Args:
        query_start_loc, seq_lens: [num_reqs + 1] / [num_reqs] host arrays.
        rows: [R] the requests (each with at least one query token).
        block_q: tokens per tile.
    """
    tiles, first_row = [], 0
    for r in rows:
        q_len = int(query_start_loc[r + 1] - query_start_loc[r])
        ctx = int(seq_lens[r]) - q_len
        for t in range(0, q_len, block_q):
            tiles.append((r, first_row + t, ctx + t, min(block_q, q_len - t)))
        first_row += q_len
    return np.array(tiles, dtype=np.int32).reshape(-1, 4).T.copy()


def mla_prefill(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, tiles: torch.Tensor, block_q: int, block_h: int,
                scale: float, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA of chunks of query tokens over the paged latent cache (their own latents
    already written), causal within a chunk.

    Args:
        q_lat: [T, H, L] the absorbed queries W_UK_h^T q_nope_h of the chunks' tokens, in the
            order of `plan_query_tiles`, fp32 / fp16 / bf16, last dimension contiguous.
        q_pe: [T, H, dr] their RoPE parts, q_lat's dtype, last dimension contiguous.
        kv_cache: [1, num_blocks, block_size, 1, L + dr] a layer's latent cache, float, int8 or
            float8_e4m3fn.
        block_table: [num_reqs, max_num_blocks] int32, last dimension contiguous.
        tiles: [4, num_tiles] int32 on q_lat's device, from `plan_query_tiles` with `block_q`.
        block_q, block_h: tokens and heads per program (`query_block`); block_h a power of
            two, block_q * block_h >= 16.
        scale: softmax scale.
        scales: the cache's float32 scales (`kv_cache_scales`): int8 [1, num_blocks,
            block_size, 1], fp8 [1]; None for a float cache.

    Returns:
        o_lat [T, H, L] in q_lat's dtype.

    Raises:
        ValueError: as `triton_mla_decode.check_latent_inputs`, or tiles / blocks that do not
            fit.
    """
    num_tokens, num_heads, kv_lora_rank = q_lat.shape
    quant = check_latent_inputs("mla_prefill", q_lat, q_pe, kv_cache, block_table, scales)
    if tiles.dim() != 2 or tiles.shape[0] != 4 or tiles.dtype != torch.int32:
        raise ValueError(f"mla_prefill: tiles must be int32 [4, num_tiles] (plan_query_tiles), "
                         f"got {tiles.dtype} {tuple(tiles.shape)}")
    if block_h & (block_h - 1) or block_q < 1 or block_q * block_h < _MIN_DOT_SIZE:
        raise ValueError(f"mla_prefill: block_q {block_q} x block_h {block_h} needs a power "
                         f"of two block_h and >= {_MIN_DOT_SIZE} rows")
    out = torch.empty_like(q_lat)
    if num_tokens == 0 or tiles.shape[1] == 0:
        return out
    tiles = tiles.contiguous()
    cache = kv_cache[0, :, :, 0]                       # [num_blocks, block_size, L + dr]
    dot_dtype = dot_dtype_for(q_lat.dtype)
    l_padded = max(_MIN_DOT_SIZE, triton.next_power_of_2(kv_lora_rank))
    _mla_prefill_kernel[(tiles.shape[1], triton.cdiv(num_heads, block_h))](
        out, q_lat, q_pe, cache, block_table if scales is None else scales, block_table,
        tiles[0], tiles[1], tiles[2], tiles[3],
        float(scale), num_heads,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=q_pe.shape[-1], L_PADDED=l_padded,
        R_PADDED=max(_MIN_DOT_SIZE, triton.next_power_of_2(q_pe.shape[-1])),
        BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_SIZE=cache.shape[1], TILE_SIZE=_TILE_SIZE,
        QUANT=quant, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
        # NOTE(gpu): untuned guess, as mla_decode's.
        num_warps=4 if block_q * block_h * l_padded <= 8192 else 8,
    )
    return out
