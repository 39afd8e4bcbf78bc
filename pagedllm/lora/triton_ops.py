"""Grouped LoRA shrink and expand in Triton, for CUDA (Punica's BGMV / SGMV: Chen et al.
2023; S-LoRA: Sheng et al. 2023). Imported only by `lora.ops.add_lora` on CUDA tensors (and by
its test, in triton's interpreter with `TRITON_INTERPRET=1`), so the engine runs without triton.

The step's adapter tokens (`LoRAMapping.token_indices`, sorted by slot, each with its slot in
`token_slots`) are the programs' first grid axis; base tokens have no program. Layouts are
lora/ops.py's:

    shrink: shrunk[i, w]  = x[token_indices[i]] . A[slot_i, w]         grid (tokens, W / BLOCK_W)
    expand: y[tok_i, n]  += shrunk[i, s(n) R : s(n) R + R] . B^T[slot_i, s(n) R :, n]
                                                                       grid (tokens, N / BLOCK_N)

where s(n) is the slice of output column n (qkv: q | k | v; gate_up: gate | up) and R the
slots' rank: each output column reads only its own slice's columns of the shrunk row. Math in
float32; y rounded once. Each token appears once, so no two programs write the same row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedllm.lora.ops import LoRAMapping


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, token_ptr, slot_ptr, K, W, stride_x,
                        stride_a_slot, stride_a_row, BLOCK_W: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    token = tl.load(token_ptr + i).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + token * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + slot * stride_a_slot + cols[:, None] * stride_a_row + ks[None, :],
                     mask=(cols[:, None] < W) & (ks[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(out_ptr + i * W + cols, acc, mask=cols < W)


@triton.jit
def _lora_expand_kernel(t_ptr, bt_ptr, y_ptr, token_ptr, slot_ptr, N, W, R, END0, END1,
                        stride_y, stride_b_slot, stride_b_row, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token = tl.load(token_ptr + i).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    piece = (ns >= END0).to(tl.int64) + (ns >= END1).to(tl.int64)   # the column's slice
    rs = tl.arange(0, BLOCK_R)
    col = piece[None, :] * R + rs[:, None]                             # [BLOCK_R, BLOCK_N]
    mask = (rs[:, None] < R) & (ns[None, :] < N)
    tv = tl.load(t_ptr + i * W + col, mask=mask, other=0.0)
    bv = tl.load(bt_ptr + slot * stride_b_slot + col * stride_b_row + ns[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    delta = tl.sum(tv * bv, axis=0)
    y_row = y_ptr + token * stride_y + ns
    yv = tl.load(y_row, mask=ns < N, other=0.0).to(tl.float32)
    tl.store(y_row, (yv + delta).to(y_ptr.dtype.element_ty), mask=ns < N)


# Whether this module's kernels were decorated for triton's interpreter (TRITON_INTERPRET=1 at
# import; they then run on CPU tensors).
INTERPRETED: bool = isinstance(_lora_shrink_kernel, InterpretedFunction)


def triton_lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor,
                              lora_b: torch.Tensor, mapping: LoRAMapping, max_rank: int,
                              slice_ends: tuple[int, ...]) -> None:
    """y += per adapter token x A_s^T B_s^T (in place), the mapping's tokens grouped by slot.

    Args:
        x: [n, in_features], y: [n, out_features] on one device (CUDA; CPU tensors only in the
            interpreter), float32 / float16 / bfloat16.
        lora_a: [max_loras, num_slices * max_rank, in_features]; lora_b: [max_loras,
            num_slices * max_rank, out_features] (B^T), both contiguous.
        mapping: the step's adapter tokens; its `token_slots` must be set.
        max_rank: R; slice_ends: the 1 to 3 slices' output ends (the last = out_features).

    Raises:
        ValueError: no `token_slots`, more than three slices, or y without unit column stride.
    """
    if mapping.token_slots is None or not 1 <= len(slice_ends) <= 3 or y.stride(1) != 1:
        raise ValueError(f"triton LoRA: needs the mapping's token_slots, 1 to 3 slices (got "
                         f"{len(slice_ends)}) and y with unit column stride")
    n, k = x.shape
    indices = mapping.token_indices
    if indices is None:
        indices = torch.arange(n, device=x.device)
    num_tokens = indices.shape[0]
    if num_tokens == 0:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    width, out = lora_a.shape[1], y.shape[1]
    shrunk = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    block_w = min(64, triton.next_power_of_2(width))
    _lora_shrink_kernel[(num_tokens, triton.cdiv(width, block_w))](
        x, lora_a, shrunk, indices, mapping.token_slots, k, width, x.stride(0),
        lora_a.stride(0), lora_a.stride(1), BLOCK_W=block_w, BLOCK_K=64)
    ends = list(slice_ends[:-1]) + [out] * (3 - len(slice_ends))
    block_n = 64
    _lora_expand_kernel[(num_tokens, triton.cdiv(out, block_n))](
        shrunk, lora_b, y, indices, mapping.token_slots, out, width, max_rank, ends[0], ends[1],
        y.stride(0), lora_b.stride(0), lora_b.stride(1), BLOCK_N=block_n,
        BLOCK_R=triton.next_power_of_2(max_rank))
