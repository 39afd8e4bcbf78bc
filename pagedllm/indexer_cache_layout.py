"""The DSA lightning indexer's K cache (DeepSeek-V3.2): layout, write and read.

Each DSA layer's indexer keeps one key of `index_head_dim` (D) values per token, beside the
layer's MLA latent cache and paged with the same block table (same slot ids), as vLLM's
`DeepseekV32IndexerCache`. One tensor per layer, in the 5-D shape the KV cache code moves
around (block axis 1):

    float ("auto" of a float KV cache):   [1, num_blocks, block_size, 1, D]      model dtype
    "C8" (int8 or float8_e4m3fn):         [1, num_blocks, block_size, 1, D + 4]  one byte each

    one C8 token row (D + 4 bytes):
    +------------------------------------------+----------------------+
    | k / scale, D values (int8 or fp8 e4m3)    | scale, float32 (4 B) |
    +------------------------------------------+----------------------+

The C8 scale is per token (symmetric, scale = max|k| / 127 for int8 or / 448 for fp8 e4m3), so a
token's key is read back as q * scale; a zero key gets scale 0. The scale sits in the row itself
(vLLM packs the indexer's fp8 values and their scales in one uint8 row too), so the tensor
carries it through the block copies of prefix caching, swapping and offloading unchanged.
Bytes per token and layer: D x element size (float), D + 4 (C8); D must be a power of two of
at least 4 in C8 (the keys written are Hadamard-rotated first, attention/backends/dsa_torch.py
`rotate_for_cache`, and the scale is read as an aligned float32).

`indexer_cache_dtype` (engine arg): "auto" follows `kv_cache_dtype` (the model dtype; an int8 or
fp8 KV cache gives a C8 indexer cache of the same kind), "int8" and "fp8_e4m3" choose C8 whatever
the latent cache holds.
"""

from __future__ import annotations

import torch

from pagedllm.kv_cache_layout import FP8_E4M3_MAX, INT8_MAX

INDEXER_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8,
                                                "fp8_e4m3": torch.float8_e4m3fn}
_SCALE_BYTES = 4
_C8_DTYPES = (torch.int8, torch.float8_e4m3fn)


def is_c8(dtype: torch.dtype) -> bool:
    """Whether an indexer cache of `dtype` is a C8 cache (values + per-token scale)."""
    return dtype in _C8_DTYPES


def resolve_indexer_cache_dtype(name: str, kv_cache_dtype: torch.dtype) -> torch.dtype:
    """The indexer cache tensor's dtype for the engine arg `indexer_cache_dtype`.

    Args:
        name: "auto", "int8" or "fp8_e4m3" ("fp8" is taken as "fp8_e4m3").
        kv_cache_dtype: the latent (KV) cache's resolved dtype, which "auto" follows.

    Raises:
        ValueError: for another name.
    """
    if name == "auto":
        return kv_cache_dtype
    name = "fp8_e4m3" if name == "fp8" else name
    if name not in INDEXER_CACHE_DTYPES:
        raise ValueError(f"indexer_cache_dtype must be 'auto' or one of "
                         f"{sorted(INDEXER_CACHE_DTYPES)}, got {name!r}")
    return INDEXER_CACHE_DTYPES[name]


def indexer_row_size(head_dim: int, dtype: torch.dtype) -> int:
    """Values per token row of the cache tensor: D, or D + 4 in C8.

    Raises:
        ValueError: C8 with D not a power of two >= 4 (naming index_head_dim).
    """
    if not is_c8(dtype):
        return head_dim
    if head_dim < _SCALE_BYTES or head_dim & (head_dim - 1):
        raise ValueError(f"an int8/fp8 indexer cache needs index_head_dim a power of two, at "
                         f"least 4 (its keys are Hadamard-rotated before quantization, and "
                         f"the per-token float32 scale follows the values), got {head_dim}")
    return head_dim + _SCALE_BYTES


def indexer_cache_bytes_per_token(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token in one layer's indexer cache of `dtype`."""
    return indexer_row_size(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def allocate_indexer_cache(num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype,
                           device: torch.device) -> torch.Tensor:
    """One layer's indexer cache [1, num_blocks, block_size, 1, row size] (module docstring);
    the null block (0) is zero."""
    cache = torch.empty((1, num_blocks, block_size, 1, indexer_row_size(head_dim, dtype)),
                        dtype=dtype, device=device)
    cache[:, 0].view(torch.uint8).zero_()
    return cache


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[num_slots, row size] uint8 (C8) or float view of the cache."""
    flat = cache.view(-1, cache.shape[-1])
    return flat.view(torch.uint8) if is_c8(cache.dtype) else flat


def quantize_indexer_keys(keys: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization: keys [n, D] -> (q [n, D] of `dtype`, scale [n] float32),
    keys ~ q * scale (module docstring)."""
    x = keys.to(torch.float32)
    qmax = INT8_MAX if dtype == torch.int8 else FP8_E4M3_MAX
    scale = x.abs().amax(dim=-1) / qmax
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (x * inv[:, None]).clamp_(-qmax, qmax)
    q = q.round_().to(torch.int8) if dtype == torch.int8 else q.to(torch.float8_e4m3fn)
    return q, scale


def write_indexer_keys(cache: torch.Tensor, keys: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' indexer keys [n, D] to their slots [n] int64 (quantized in C8)."""
    rows = _rows(cache)
    if not is_c8(cache.dtype):
        rows.index_copy_(0, slot_mapping, keys.to(cache.dtype))
        return
    q, scale = quantize_indexer_keys(keys, cache.dtype)
    # NOTE(kv_quant): torch's CPU index ops do not take float8; the bytes are copied as uint8.
    packed = torch.cat((q.view(torch.uint8), scale[:, None].view(torch.uint8)), dim=-1)
    rows.index_copy_(0, slot_mapping, packed)


def read_indexer_keys(cache: torch.Tensor, slots: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The keys at `slots` [m] int64, dequantized: [m, D] in `dtype`."""
    rows = _rows(cache).index_select(0, slots)
    if not is_c8(cache.dtype):
        return rows.to(dtype)
    head_dim = rows.shape[-1] - _SCALE_BYTES
    q = rows[:, :head_dim].contiguous().view(cache.dtype)
    scale = rows[:, head_dim:].contiguous().view(torch.float32)          # [m, 1]
    return (q.to(torch.float32) * scale).to(dtype)
