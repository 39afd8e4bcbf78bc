"""unified_attention: one Triton kernel for a mixed batch of prefill chunks and decodes that reads
K/V through the block table where they lie in the paged cache.

The design is vLLM's "unified attention" (`vllm/attention/ops/triton_unified_attention.py`, 2-D
variant); the softmax is FlashAttention-2's online softmax (Dao, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning", 2023, Algorithm 1): per query row a
running max `m`, a running sum `l` and an unnormalised accumulator, rescaled by `exp(m_old - m_new)`
when a tile raises the max, divided by `l` once at the end.

Grid: (query blocks over all requests, KV heads). A query block holds BLOCK_Q consecutive query
tokens of one request together with the `R = num_heads // num_kv_heads` query heads sharing the
program's KV head (GQA), so each K/V tile is loaded once for the whole group:

    rows m = 0 .. BLOCK_M-1 (BLOCK_M = BLOCK_Q * R, padded to >= 16 for tl.dot):
        token  = request start + q_block * BLOCK_Q + m // R
        head   = kv_head * R + m % R

Requests' query blocks are laid out without a prefix sum on the host: request r's blocks start at
`query_start_loc[r] // BLOCK_Q + r`, an upper bound (each request gets at most one block more than
it needs), so the grid is `num_tokens // BLOCK_Q + num_reqs`; a program finds its request by
binary search over `query_start_loc` and returns at once when its block is past the request's
queries. The KV loop walks tiles of TILE_SIZE positions (independent of the cache block size: each
position looks up its own block id), from the first tile inside the sliding window (tiles wholly
before it are skipped) to the last position any query of the block may see (causal).

Query i of request r sits at absolute position `seq_lens[r] - query_len[r] + i` (chunked prefill
continues after the cached context) and sees key positions `<= position` (causal) and, with a
window W, `> position - W`. With `attend_until` (Gemma 3's image tokens, which attend to each
other bidirectionally) a query's causal horizon is `attend_until[token]` instead of its position
(the window still counts from the position); the block's KV loop then runs to the largest horizon
of its rows. Without it the kernel is compiled without the load (a constexpr switch). Scores are
fp32: `s = scale * q.k`, then `cap * tanh(s / cap)` with soft-capping; both dots take operands
in the query dtype (fp32, fp16 or bf16; K/V tiles and the probabilities are cast to it) and
accumulate in fp32; fp32 dots use IEEE precision (no TF32).
Head sizes that are not a power of two are padded with masked lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# tl.dot needs every dimension >= 16.
_MIN_DOT_SIZE = 16


@triton.jit
def _find_request(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q: tl.constexpr):
    """The request r whose query blocks contain `q_block_global`: the largest r with
    query_start_loc[r] // BLOCK_Q + r <= q_block_global (binary search)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1) (exact at +-inf, no libdevice,
    so it also runs in the interpreter)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with both operands in DOT_DTYPE, fp32 accumulation."""
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, attend_until_ptr,
    scale, soft_cap, num_reqs,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_k_blk, stride_k_slot, stride_k_head,
    stride_v_blk, stride_v_slot, stride_v_head,
    stride_bt_row,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, SLIDING_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_ATTEND_UNTIL: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)

    req = _find_request(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block_global - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    q_index = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV       # [BLOCK_M]
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_index < query_len)
    dim_valid = offs_d < HEAD_SIZE
    token = (q_start + q_index).to(tl.int64)
    q_pos = context_len + q_index                                          # absolute position
    # The last key position each row may see (causal): its own, or its image's last one.
    if USE_ATTEND_UNTIL:
        horizon = tl.load(attend_until_ptr + token, mask=row_valid, other=0).to(tl.int32)
        horizon = tl.where(row_valid, horizon, q_pos)
    else:
        horizon = q_pos

    q = tl.load(q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + offs_d[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Key positions [kv_lo, kv_hi) cover every query row of the block.
    first_q_pos = context_len + q_block_local * BLOCK_Q
    if CAUSAL:
        if USE_ATTEND_UNTIL:
            kv_hi = tl.minimum(tl.max(tl.where(row_valid, horizon, 0)) + 1, seq_len)
        else:
            kv_hi = tl.minimum(first_q_pos + BLOCK_Q, seq_len)
    else:
        kv_hi = seq_len
    kv_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_row

    for tile in range(kv_lo // TILE_SIZE, tl.cdiv(kv_hi, TILE_SIZE)):
        k_pos = tile * TILE_SIZE + offs_t                                  # [TILE_SIZE]
        k_valid = k_pos < kv_hi
        block_id = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot_in_block = (k_pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(key_cache_ptr + block_id[None, :] * stride_k_blk
                    + slot_in_block[None, :] * stride_k_slot + kv_head * stride_k_head
                    + offs_d[:, None], mask=dim_valid[:, None] & k_valid[None, :],
                    other=0.0)                                             # [D, TILE]
        v = tl.load(value_cache_ptr + block_id[:, None] * stride_v_blk
                    + slot_in_block[:, None] * stride_v_slot + kv_head * stride_v_head
                    + offs_d[None, :], mask=k_valid[:, None] & dim_valid[None, :],
                    other=0.0)                                             # [TILE, D]

        s = _dot(q, k, DOT_DTYPE, DOT_PRECISION) * scale                   # [M, TILE] fp32
        if USE_SOFT_CAP:
            s = _soft_cap(s, soft_cap)
        allowed = row_valid[:, None] & k_valid[None, :]
        if CAUSAL:
            allowed = allowed & (k_pos[None, :] <= horizon[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: a row with nothing allowed so far keeps m = -inf; subtracting 0 instead keeps
        # exp() at 0 rather than NaN (-inf - -inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, v, DOT_DTYPE, DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])


# Whether this module's kernels were decorated for triton's interpreter (TRITON_INTERPRET=1 at
# import; they then run on CPU tensors).
INTERPRETED: bool = isinstance(_unified_attention_kernel, InterpretedFunction)

def _launch_shape(num_queries_per_kv: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): BLOCK_M rows = BLOCK_Q tokens x the query heads of one KV head,
    at least 16 (tl.dot's minimum) and a power of two."""
    block_m = max(_MIN_DOT_SIZE, triton.next_power_of_2(num_queries_per_kv))
    return block_m // num_queries_per_kv, block_m


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, num_actual_tokens: int, max_query_len: int,
                      scale: float, causal: bool = True, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None,
                      attend_until: torch.Tensor | None = None) -> None:
    """Paged attention of a mixed prefill/decode batch, written into `out` (in place).

    Args:
        query: [num_tokens, num_heads, head_size] fp32/fp16/bf16, last dimension contiguous;
            only the first `num_actual_tokens` rows are read.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], last
            dimension contiguous, any of fp32/fp16/bf16 (cast to query's dtype in the kernel).
        out: like query; rows of the first `num_actual_tokens` tokens are written, the rest are
            left untouched.
        query_start_loc: [num_reqs + 1] int32 on query's device, cumulative query lengths
            (query_start_loc[-1] == num_actual_tokens).
        seq_lens: [num_reqs] int32, cached context + query length per request.
        block_table: [num_reqs, max_num_blocks] int32, block ids of each request's positions
            (row stride free, last dimension contiguous).
        max_query_len: longest query of the step (picks the KV tile size).
        scale: softmax scale applied to q.k.
        causal: False for encoder-only models (every query sees all `seq_len` keys).
        sliding_window: a query at position p sees key positions > p - window; None = all.
        logits_soft_cap: scores s become cap * tanh(s / cap) before the softmax; None = off.
        attend_until: [>= num_actual_tokens] int32/int64 on query's device, contiguous: the
            last key position each query token may see (causal steps only; at least its own
            position, less than its request's seq_len), e.g. an image's last position for that
            image's tokens (Gemma 3); None = its own position (causal).

    Raises:
        ValueError: for shapes that do not fit each other, num_heads not a multiple of
            num_kv_heads, a dtype other than fp32/fp16/bf16, a non-contiguous head dimension,
            or an `attend_until` that is not a contiguous int32/int64 vector covering the
            tokens (or is given with causal=False).
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.dim() != 4 or key_cache.shape[3] != head_size \
            or value_cache.shape != key_cache.shape:
        raise ValueError(f"unified_attention: caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)} do not fit queries {tuple(query.shape)}; "
                         f"expected [num_blocks, block_size, num_kv_heads, {head_size}]")
    if num_heads % num_kv_heads:
        raise ValueError(f"unified_attention: num_heads {num_heads} is not a multiple of "
                         f"num_kv_heads {num_kv_heads}")
    if out.shape != query.shape:
        raise ValueError(f"unified_attention: out shape {tuple(out.shape)} != query shape "
                         f"{tuple(query.shape)}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("out", out)):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unified_attention: {name} dtype {t.dtype} is not one of "
                             f"float32, float16, bfloat16")
        if t.stride(-1) != 1:
            raise ValueError(f"unified_attention: {name} needs a contiguous last dimension")
    if block_table.stride(-1) != 1:
        raise ValueError("unified_attention: block_table needs a contiguous last dimension")
    if attend_until is not None:
        if not causal:
            raise ValueError("unified_attention: attend_until applies to causal steps only")
        if (attend_until.dim() != 1 or attend_until.dtype not in (torch.int32, torch.int64)
                or attend_until.stride(0) != 1 or attend_until.shape[0] < num_actual_tokens
                or attend_until.device != query.device):
            raise ValueError(f"unified_attention: attend_until must be a contiguous int32/int64 "
                             f"vector of >= {num_actual_tokens} tokens on {query.device}, got "
                             f"{attend_until.dtype} {tuple(attend_until.shape)} on "
                             f"{attend_until.device}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"unified_attention: query_start_loc shape "
                         f"{tuple(query_start_loc.shape)} != ({num_reqs + 1},)")
    if num_actual_tokens == 0 or num_reqs == 0:
        return

    rep = num_heads // num_kv_heads
    block_q, block_m = _launch_shape(rep)
    # NOTE(perf): smaller tiles for decode-only steps (one query row per head group, the loop is
    # bound by loads), larger for prefill (more work per loaded tile); vLLM uses 16 / 32 too.
    tile_size = 16 if max_query_len <= 1 else 32
    dot_dtype = _TL_DTYPES[query.dtype]
    if INTERPRETED and dot_dtype == tl.bfloat16:
        # NOTE: triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 bits;
        # products of bf16 values are exact in fp32, so fp32 operands give the same sums.
        dot_dtype = tl.float32
    grid = (num_actual_tokens // block_q + num_reqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        seq_lens if attend_until is None else attend_until,   # (not read without it)
        float(scale), float(logits_soft_cap or 1.0), num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        NUM_QUERIES_PER_KV=rep, BLOCK_SIZE=key_cache.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=max(_MIN_DOT_SIZE, triton.next_power_of_2(head_size)),
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_SIZE=tile_size,
        CAUSAL=bool(causal), SLIDING_WINDOW=int(sliding_window or 0),
        USE_SOFT_CAP=logits_soft_cap is not None, USE_ATTEND_UNTIL=attend_until is not None,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
    )
