"""mla_decode: Multi-head Latent Attention decode in the absorbed form over the paged latent cache
(Triton), with split-K over long contexts.

MLA (DeepSeek-V2, arXiv:2405.04434, sec. 2.1) caches per token one latent row
`[c_kv (L = kv_lora_rank) | k_pe (dr = qk_rope_head_dim)]` shared by every head. In the absorbed
form a decode query of head h is `[q_lat_h (L) | q_pe_h (dr)]` with q_lat_h = W_UK_h^T q_nope_h
(folded outside the kernel), and

    score[h, t] = scale * (q_lat_h . c_kv[t] + q_pe_h . k_pe[t])
    o_lat[h]    = sum_t softmax_t(score[h, :]) c_kv[t]                    [H, L]

(W_UV is applied to o_lat outside the kernel). The heads of a request are the rows of one
program's tiles: each latent tile is loaded once and serves all of them (up to `block_h` heads
per program, 64 by default, so every model with <= 64 heads per rank reads each latent row once
per split), which is the point of MLA: a decode step reads L + dr values per context token,
not H (dn + dv) as per-head K/V would.

Two launches, the design of vLLM's Triton MLA decode (`triton_decode_attention.py`: grouped
heads, split KV, a reduce stage) with FlashAttention-2's online softmax (Dao 2023, Algorithm 1)
inside a split and the log-sum-exp merge of split-K ("flash decoding") across splits:

1. stage 1, grid (decode rows, KV splits, head blocks): a program walks its split's positions
   in tiles of TILE_SIZE (each position looks up its block id in the request's block table, so
   the tile size is free of the cache block size), keeps a running max, sum and unnormalised
   [BLOCK_H, L] accumulator, and writes the normalised partial output and its log-sum-exp
   (fp32) to scratch buffers [rows, max_splits, H, L] / [rows, max_splits, H];
2. stage 2, grid (decode rows, head blocks): merges the row's splits per head, weights
   exp(lse_s - max lse).

A request's number of splits depends only on its own length, `min(max_splits, cdiv(seq_len,
split_tokens))`, and its split boundaries are TILE_SIZE-aligned shares of it: the result of a
request never depends on the other requests of the batch (batch invariant); programs past a
request's splits return at once. Split lengths are runtime values, so neither a context
length nor a batch recompiles the kernels.

Quantized latent caches (kv_cache_layout.py) are dequantized inside the loop without
materialising floats: int8 has one float32 scale per token (scores and probabilities of a
column are multiplied by it, since s_t (q . x_t) = q . (s_t x_t) and p_t (s_t x_t) = (p_t s_t)
x_t), fp8 e4m3 one per tensor. Dots take operands in the query dtype (fp32 / fp16 / bf16) and
accumulate in fp32; fp32 dots use IEEE precision.

NOTE(gpu): written and tested under triton's interpreter only (no GPU on the machines this was
built on): block sizes and warp counts are untuned, and the compiled path (register pressure of
a [64, 512] fp32 accumulator, fp8 conversion on the target architecture) is unchecked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedllm.attention.ops.triton_unified_attention import _MIN_DOT_SIZE, _TL_DTYPES

# Cache quantization modes (constexpr QUANT).
_QUANT_NONE, _QUANT_PER_TOKEN, _QUANT_PER_TENSOR = 0, 1, 2
# Heads per program at most: all of a request's heads share one latent tile up to this count.
DEFAULT_BLOCK_H = 64
# A request is split into KV splits of at least this many positions, at most MAX_KV_SPLITS.
DEFAULT_SPLIT_TOKENS = 256
MAX_KV_SPLITS = 16
_TILE_SIZE = 16


@triton.jit
def _split_range(seq_len, split, max_splits, split_tokens, TILE_SIZE: tl.constexpr):
    """[lo, hi) positions of KV split `split` of a request of `seq_len` positions (empty past
    its last split); the request has min(max_splits, cdiv(seq_len, split_tokens)) splits."""
    num_splits = tl.minimum(max_splits, tl.cdiv(seq_len, split_tokens))
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_SIZE) * TILE_SIZE
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    return lo, hi, num_splits


@triton.jit
def _mla_decode_stage1_kernel(
    part_out_ptr, part_lse_ptr, q_lat_ptr, q_pe_ptr, cache_ptr, scales_ptr,
    block_table_ptr, seq_lens_ptr, decode_reqs_ptr,
    scale, num_heads, max_splits, split_tokens,
    stride_ql_row, stride_ql_head, stride_qp_row, stride_qp_head,
    stride_c_blk, stride_c_slot, stride_bt_row,
    stride_po_row, stride_po_split, stride_po_head, stride_pl_row, stride_pl_split,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    L_PADDED: tl.constexpr, R_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr,
    QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    head_block = tl.program_id(2)
    req = tl.load(decode_reqs_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    kv_lo, kv_hi, _ = _split_range(seq_len, split, max_splits, split_tokens, TILE_SIZE)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, L_PADDED)
    offs_r = tl.arange(0, R_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    head_valid = offs_h < num_heads
    l_valid = offs_l < KV_LORA_RANK
    r_valid = offs_r < ROPE_DIM

    q_lat = tl.load(q_lat_ptr + row * stride_ql_row + offs_h[:, None] * stride_ql_head
                    + offs_l[None, :], mask=head_valid[:, None] & l_valid[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + row * stride_qp_row + offs_h[:, None] * stride_qp_head
                   + offs_r[None, :], mask=head_valid[:, None] & r_valid[None, :], other=0.0)
    q_lat = q_lat.to(DOT_DTYPE)
    q_pe = q_pe.to(DOT_DTYPE)
    tensor_scale = 1.0
    if QUANT == 2:
        tensor_scale = tl.load(scales_ptr)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PADDED], dtype=tl.float32)
    bt_row = block_table_ptr + req * stride_bt_row

    for tile in range(kv_lo // TILE_SIZE, tl.cdiv(kv_hi, TILE_SIZE)):
        k_pos = tile * TILE_SIZE + offs_t                                  # [TILE]
        k_valid = (k_pos >= kv_lo) & (k_pos < kv_hi)
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

        # NOTE(perf): dots written inline, not through a jitted helper: triton's interpreter
        # re-patches its whole language on every nested jitted call (the engine test ran
        # ~30% longer with three helper calls per tile).
        s = (tl.dot(q_lat, tl.trans(c_kv).to(DOT_DTYPE), input_precision=DOT_PRECISION)
             + tl.dot(q_pe, tl.trans(k_pe).to(DOT_DTYPE), input_precision=DOT_PRECISION))
        if QUANT == 1:
            token_scale = tl.load(scales_ptr + block_id * BLOCK_SIZE + slot_in_block,
                                  mask=k_valid, other=0.0)
            s = s * token_scale[None, :]
        elif QUANT == 2:
            s = s * tensor_scale
        s = tl.where(head_valid[:, None] & k_valid[None, :], s * scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: a row with nothing allowed keeps m = -inf; subtracting 0 keeps exp() at 0
        # rather than NaN (-inf - -inf).
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

    # An empty split (past the request's last) leaves l = 0: lse -inf, output 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
    out = acc / l_safe[:, None]
    tl.store(part_out_ptr + row * stride_po_row + split * stride_po_split
             + offs_h[:, None] * stride_po_head + offs_l[None, :], out,
             mask=head_valid[:, None] & l_valid[None, :])
    tl.store(part_lse_ptr + row * stride_pl_row + split * stride_pl_split + offs_h, lse,
             mask=head_valid)


@triton.jit
def _mla_decode_stage2_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, decode_reqs_ptr,
    num_heads, max_splits, split_tokens,
    stride_o_row, stride_o_head,
    stride_po_row, stride_po_split, stride_po_head, stride_pl_row, stride_pl_split,
    KV_LORA_RANK: tl.constexpr, L_PADDED: tl.constexpr, BLOCK_H: tl.constexpr,
    TILE_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    req = tl.load(decode_reqs_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    _, _, num_splits = _split_range(seq_len, 0, max_splits, split_tokens, TILE_SIZE)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, L_PADDED)
    head_valid = offs_h < num_heads
    mask = head_valid[:, None] & (offs_l[None, :] < KV_LORA_RANK)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PADDED], dtype=tl.float32)
    for split in range(0, num_splits):
        lse = tl.load(part_lse_ptr + row * stride_pl_row + split * stride_pl_split + offs_h,
                      mask=head_valid, other=float("-inf"))
        o = tl.load(part_out_ptr + row * stride_po_row + split * stride_po_split
                    + offs_h[:, None] * stride_po_head + offs_l[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * o
        total = total * alpha + w
        m = m_new
    total = tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_o_row + offs_h[:, None] * stride_o_head + offs_l[None, :],
             (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# Whether this module's kernels were decorated for triton's interpreter (TRITON_INTERPRET=1 at
# import; they then run on CPU tensors).
INTERPRETED: bool = isinstance(_mla_decode_stage1_kernel, InterpretedFunction)


def num_kv_splits(max_seq_len: int, split_tokens: int = DEFAULT_SPLIT_TOKENS) -> int:
    """KV splits of the longest request of a step (the launch grid's split dimension)."""
    return max(1, min(MAX_KV_SPLITS, -(-max_seq_len // split_tokens)))


def check_latent_inputs(who: str, q_lat: torch.Tensor, q_pe: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor,
                        scales: torch.Tensor | None) -> int:
    """Checks the absorbed queries and the latent cache the MLA kernels take (`mla_decode`'s
    arguments; `who` names the caller in messages) and returns the cache's quantization mode
    (constexpr QUANT: 0 float, 1 int8 per token, 2 fp8 per tensor).

    Raises:
        ValueError: shapes that do not fit each other, an unsupported dtype, a quantized cache
            without its scales, or a non-contiguous last dimension.
    """
    num_rows, num_heads, kv_lora_rank = q_lat.shape
    rope_dim = q_pe.shape[-1]
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1
            or kv_cache.shape[4] != kv_lora_rank + rope_dim):
        raise ValueError(f"{who}: latent cache {tuple(kv_cache.shape)} does not fit "
                         f"queries of L={kv_lora_rank} and dr={rope_dim}; expected [1, "
                         f"num_blocks, block_size, 1, {kv_lora_rank + rope_dim}]")
    if q_pe.shape[:2] != (num_rows, num_heads) or q_pe.dtype != q_lat.dtype:
        raise ValueError(f"{who}: q_pe {tuple(q_pe.shape)} {q_pe.dtype} does not fit q_lat "
                         f"{tuple(q_lat.shape)} {q_lat.dtype}")
    if q_lat.dtype not in _TL_DTYPES:
        raise ValueError(f"{who}: query dtype {q_lat.dtype} is not one of float32, "
                         "float16, bfloat16")
    if kv_cache.dtype == torch.int8:
        quant = _QUANT_PER_TOKEN
        want_scales = (1, kv_cache.shape[1], kv_cache.shape[2], 1)
    elif kv_cache.dtype == torch.float8_e4m3fn:
        quant, want_scales = _QUANT_PER_TENSOR, (1,)
    elif kv_cache.dtype in _TL_DTYPES:
        quant, want_scales = _QUANT_NONE, None
    else:
        raise ValueError(f"{who}: latent cache dtype {kv_cache.dtype} is not supported")
    if want_scales is not None and (scales is None or tuple(scales.shape) != want_scales
                                    or scales.dtype != torch.float32
                                    or not scales.is_contiguous()):
        raise ValueError(f"{who}: a {kv_cache.dtype} cache needs its contiguous float32 "
                         f"scales of shape {list(want_scales)} (kv_cache_scales)")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_cache", kv_cache),
                    ("block_table", block_table)):
        if t.stride(-1) != 1:
            raise ValueError(f"{who}: {name} needs a contiguous last dimension")
    return quant


def dot_dtype_for(dtype: torch.dtype):
    """The tl dtype of dot operands for queries of `dtype` (fp32 under triton's interpreter for
    bf16, whose interpreted dots multiply bf16 operands as raw bits)."""
    dot_dtype = _TL_DTYPES[dtype]
    if INTERPRETED and dot_dtype == tl.bfloat16:
        # NOTE: triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 bits
        # (see triton_unified_attention); products of bf16 values are exact in fp32.
        dot_dtype = tl.float32
    return dot_dtype


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, decode_reqs: torch.Tensor,
               scale: float, max_seq_len: int, scales: torch.Tensor | None = None,
               split_tokens: int = DEFAULT_SPLIT_TOKENS,
               block_h: int = DEFAULT_BLOCK_H) -> torch.Tensor:
    """Absorbed MLA decode of one query token per row over the paged latent cache.

    Args:
        q_lat: [R, H, L] the absorbed queries W_UK_h^T q_nope_h of R decode rows, fp32 / fp16 /
            bf16, last dimension contiguous.
        q_pe: [R, H, dr] their RoPE parts, q_lat's dtype, last dimension contiguous.
        kv_cache: [1, num_blocks, block_size, 1, L + dr] a layer's latent cache
            (layers/mla_attention.py), float (any of fp32 / fp16 / bf16), int8 or float8_e4m3fn.
        block_table: [num_reqs, max_num_blocks] int32, last dimension contiguous.
        seq_lens: [num_reqs] int32, positions per request (the decode token's included; it must
            already be in the cache).
        decode_reqs: [R] int32, the request (row of block_table / seq_lens) of each decode row.
        scale: softmax scale.
        max_seq_len: an upper bound of seq_lens[decode_reqs] (sizes the split grid).
        scales: the cache's float32 scales (`kv_cache_scales`): int8 [1, num_blocks, block_size,
            1], fp8 [1]; None for a float cache.
        split_tokens: a request is split into KV splits of >= this many positions (at most
            MAX_KV_SPLITS); a request's result depends on its own length only.
        block_h: heads per program at most (a power of two >= 16).

    Returns:
        o_lat [R, H, L] in q_lat's dtype: softmax(scores) @ c_kv per row and head.

    Raises:
        ValueError: for shapes that do not fit each other, an unsupported dtype, a quantized
            cache without its scales, or a non-contiguous last dimension.
    """
    num_rows, num_heads, kv_lora_rank = q_lat.shape
    rope_dim = q_pe.shape[-1]
    quant = check_latent_inputs("mla_decode", q_lat, q_pe, kv_cache, block_table, scales)
    if decode_reqs.shape != (num_rows,):
        raise ValueError(f"mla_decode: decode_reqs shape {tuple(decode_reqs.shape)} != "
                         f"({num_rows},)")
    if block_h < _MIN_DOT_SIZE or block_h & (block_h - 1):
        raise ValueError(f"mla_decode: block_h {block_h} is not a power of two >= 16")
    out = torch.empty_like(q_lat)
    if num_rows == 0:
        return out

    splits = num_kv_splits(max_seq_len, split_tokens)
    part_out = torch.empty(num_rows, splits, num_heads, kv_lora_rank, dtype=torch.float32,
                           device=q_lat.device)
    part_lse = torch.empty(num_rows, splits, num_heads, dtype=torch.float32,
                           device=q_lat.device)
    block_h = min(block_h, max(_MIN_DOT_SIZE, triton.next_power_of_2(num_heads)))
    dot_dtype = dot_dtype_for(q_lat.dtype)
    cache = kv_cache[0, :, :, 0]                       # [num_blocks, block_size, L + dr]
    l_padded = max(_MIN_DOT_SIZE, triton.next_power_of_2(kv_lora_rank))
    _mla_decode_stage1_kernel[(num_rows, splits, triton.cdiv(num_heads, block_h))](
        part_out, part_lse, q_lat, q_pe, cache, seq_lens if scales is None else scales,
        block_table, seq_lens, decode_reqs,
        float(scale), num_heads, splits, int(split_tokens),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, L_PADDED=l_padded,
        R_PADDED=max(_MIN_DOT_SIZE, triton.next_power_of_2(rope_dim)),
        BLOCK_H=block_h, BLOCK_SIZE=cache.shape[1], TILE_SIZE=_TILE_SIZE, QUANT=quant,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
        # NOTE(gpu): untuned guess: 8 warps once the fp32 accumulator passes 64 values per
        # thread of 4 warps (16 heads x 512), to limit register spills.
        num_warps=4 if block_h * l_padded <= 8192 else 8,
    )
    _mla_decode_stage2_kernel[(num_rows, triton.cdiv(num_heads, block_h))](
        out, part_out, part_lse, seq_lens, decode_reqs, num_heads, splits, int(split_tokens),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        KV_LORA_RANK=kv_lora_rank, L_PADDED=l_padded, BLOCK_H=block_h, TILE_SIZE=_TILE_SIZE,
    )
    return out
