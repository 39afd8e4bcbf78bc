"""reshape_and_cache: write the new tokens' K/V into their slots of the paged KV cache (Triton).

One program per new token copies its [num_kv_heads, head_size] key and value rows to slot
`slot_mapping[token]` of the cache, i.e. block `slot // block_size`, offset `slot % block_size`:

    key [num_tokens, KVH, D] ──slot_mapping──► key_cache [num_blocks, block_size, KVH, D]

A slot of -1 (`PAD_SLOT_ID`: padded tokens of a CUDA-graph batch) is skipped. The values are
cast to the cache dtype on the store. vLLM names this op `reshape_and_cache_flash`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction



@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_blk, stride_kc_slot, stride_kc_head,
    stride_vc_blk, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, NUM_KV_HEADS_PADDED)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)

    k = tl.load(key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :],
                mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head
                + dims[None, :], mask=mask)
    kc = (key_cache_ptr + block * stride_kc_blk + offset * stride_kc_slot
          + heads[:, None] * stride_kc_head + dims[None, :])
    vc = (value_cache_ptr + block * stride_vc_blk + offset * stride_vc_slot
          + heads[:, None] * stride_vc_head + dims[None, :])
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


# Whether this module's kernels were decorated for triton's interpreter (TRITON_INTERPRET=1 at
# import; they then run on CPU tensors).
INTERPRETED: bool = isinstance(_reshape_and_cache_kernel, InterpretedFunction)

def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` rows into the paged cache at `slot_mapping` (in place).

    Args:
        key, value: [num_tokens, num_kv_heads, head_size], any float dtype; the last dimension
            contiguous.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size] (the two halves
            of a layer's `kv_cache`), last dimension contiguous.
        slot_mapping: [num_tokens] int32/int64, `block_id * block_size + offset`; -1 = skip.

    Raises:
        ValueError: on mismatched shapes, a non-contiguous head dimension, or a slot_mapping of
            another length.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if value.shape != key.shape:
        raise ValueError(f"reshape_and_cache: value shape {tuple(value.shape)} != key shape "
                         f"{tuple(key.shape)}")
    if key_cache.dim() != 4 or key_cache.shape[2:] != (num_kv_heads, head_size) \
            or value_cache.shape != key_cache.shape:
        raise ValueError(f"reshape_and_cache: caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)} do not fit keys {tuple(key.shape)}; "
                         f"expected [num_blocks, block_size, {num_kv_heads}, {head_size}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"reshape_and_cache: slot_mapping shape {tuple(slot_mapping.shape)} "
                         f"!= ({num_tokens},)")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"reshape_and_cache: {name} needs a contiguous last dimension")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_SIZE=key_cache.shape[1],
    )
