"""Quantized KV caches (`kv_cache_dtype` "int8" and "fp8_e4m3"): layout, write and dequantize.

A layer's KV cache stays one tensor [2, num_blocks, block_size, num_kv_heads, head_size] (the shape
every backend expects), now of a one-byte dtype; its scales sit in the same allocation, right
after the K/V bytes, so that the tensor bound to the layer carries them wherever it goes:

    one uint8 allocation per layer
    +---------------------------------------------+-----+-------------------------------------+
    | K/V  [2, num_blocks, block_size, KVH, D]     | pad | scales, float32                      |
    | int8 or float8_e4m3fn (= the layer's cache)  | <4B | int8: [2, num_blocks, block_size, KVH] |
    |                                              |     | fp8:  [2] (k_scale, v_scale)          |
    +---------------------------------------------+-----+-------------------------------------+

- int8: symmetric quantization per (token, KV head) at write time, scale = max|x| / 127 and
  q = round(x / scale) in [-127, 127]; x ~ q * scale. The scale of a row lives at the same
  [kv, block, offset, head] index as the row.
- fp8_e4m3: torch.float8_e4m3fn with one scale per tensor (k_scale, v_scale), x ~ q * scale.
  NOTE(kv_quant): the scales are 1.0, vLLM's default without calibration: an fp8 value keeps 3
  mantissa bits over [2^-9, 448], wider than the K/V range of the models we serve; values beyond
  +-448 * scale are clamped (vLLM clamps too). They are stored, not hard-wired, so calibrated
  scales can be written later without touching the kernels.

An MLA latent cache (attention/backends/mla_torch.py) is the same layout with one tensor instead
of two and one "head" of kv_lora_rank + qk_rope_head_dim values: [1, num_blocks, block_size, 1,
latent_size] (`num_kv` = 1 below), its int8 scales [1, num_blocks, block_size, 1] and fp8 scale [1].

This module is the one place that knows the layout; the backends call `write_kv_cache` (or
`write_cache_rows`), `kv_cache_scales` and `dequantize_kv` and never index the allocation
themselves.
"""

from __future__ import annotations

import torch

# kv_cache_dtype name -> the cache tensor's dtype ("auto" = the model dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8,
                                           "fp8_e4m3": torch.float8_e4m3fn}
INT8_MAX = 127.0
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)   # 448
_SCALE_BYTES = 4


def is_quantized_kv_cache(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` is an int8 or fp8 cache (with its scales after it)."""
    return kv_cache.dtype in (torch.int8, torch.float8_e4m3fn)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a `kv_cache_dtype` name.

    Raises:
        ValueError: for a name other than "auto", "int8" or "fp8_e4m3".
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def _scale_shape(dtype: torch.dtype, num_blocks: int, block_size: int, num_kv_heads: int,
                 num_kv: int = 2) -> tuple[int, ...]:
    return (num_kv, num_blocks, block_size, num_kv_heads) if dtype == torch.int8 else (num_kv,)


def _data_bytes_padded(numel: int) -> int:
    return -(-numel // _SCALE_BYTES) * _SCALE_BYTES


def kv_cache_block_bytes(block_size: int, num_kv_heads: int, head_size: int,
                         dtype: torch.dtype, num_kv: int = 2) -> int:
    """Bytes of one block of one layer, K and V (`num_kv` = 2; 1 for an MLA latent cache),
    scales included (int8: 4 bytes per token and KV head; fp8's per-tensor scales are per
    layer, not per block, and not counted)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = num_kv_heads * head_size * elem
    if dtype == torch.int8:
        per_token += num_kv_heads * _SCALE_BYTES
    return num_kv * block_size * per_token


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, device: torch.device,
                      num_kv: int = 2) -> torch.Tensor:
    """One layer's KV cache [num_kv, num_blocks, block_size, num_kv_heads, head_size] in
    `dtype` (num_kv = 2: K and V; 1: an MLA latent cache); for int8/fp8 with its scales after
    it (module docstring), all zero except fp8's scales (1.0). The null block is zero either
    way."""
    shape = (num_kv, num_blocks, block_size, num_kv_heads, head_size)
    if dtype not in KV_CACHE_DTYPES.values():
        cache = torch.empty(shape, dtype=dtype, device=device)
        cache[:, 0].zero_()
        return cache
    numel = num_kv * num_blocks * block_size * num_kv_heads * head_size
    scale_shape = _scale_shape(dtype, num_blocks, block_size, num_kv_heads, num_kv)
    num_scales = 1
    for s in scale_shape:
        num_scales *= s
    buf = torch.zeros(_data_bytes_padded(numel) + num_scales * _SCALE_BYTES, dtype=torch.uint8,
                      device=device)
    cache = buf[:numel].view(dtype).view(shape)
    if dtype == torch.float8_e4m3fn:
        kv_cache_scales(cache).fill_(1.0)
    return cache


def kv_cache_scales(kv_cache: torch.Tensor) -> torch.Tensor:
    """The float32 scales stored after a quantized cache (a view: writes go to the cache).

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size] int8 or float8_e4m3fn,
            made by `allocate_kv_cache` (the whole tensor, not a slice of it).

    Returns:
        int8: [2, num_blocks, block_size, num_kv_heads]; fp8: [2] = (k_scale, v_scale)
        (a latent cache: [1, ...] and [1]).

    Raises:
        ValueError: if the tensor is not a quantized cache made by `allocate_kv_cache`.
    """
    if not is_quantized_kv_cache(kv_cache) or kv_cache.dim() != 5:
        raise ValueError(f"kv_cache_scales: expected a 5-D int8/fp8 KV cache, got "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    num_kv, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    scale_shape = _scale_shape(kv_cache.dtype, num_blocks, block_size, num_kv_heads, num_kv)
    num_scales = 1
    for s in scale_shape:
        num_scales *= s
    offset = _data_bytes_padded(kv_cache.numel())
    storage = kv_cache.untyped_storage()
    if (kv_cache.storage_offset() != 0 or not kv_cache.is_contiguous()
            or storage.nbytes() != offset + num_scales * _SCALE_BYTES):
        raise ValueError("kv_cache_scales: this int8/fp8 KV cache has no scales after it "
                         "(allocate it with allocate_kv_cache, and pass the whole tensor)")
    scales = torch.empty(0, dtype=torch.float32, device=kv_cache.device)
    return scales.set_(storage, offset // _SCALE_BYTES, scale_shape)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row of the last dimension.

    Args:
        x: [..., head_size] floating.

    Returns:
        (q [..., head_size] int8 in [-127, 127], scale [...] float32 = max|x| / 127; a row of
        zeros gets scale 0 and dequantizes to zeros).
    """
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=-1) / INT8_MAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x32 * inv[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale clamped to +-448 in float8_e4m3fn (round to nearest even), shape of x."""
    x32 = x.to(torch.float32) / scale
    return x32.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new K/V rows into their slots, quantizing for an int8/fp8 cache.

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size], any cache dtype.
        key, value: [n, num_kv_heads, head_size] for the n new tokens.
        slot_mapping: [n] int64, block_id * block_size + offset.

    Returns:
        (key, value) as the cache now holds them, dequantized, in key's dtype ([n, KVH, D]); for an
        unquantized cache the inputs themselves (a float32 cache of bf16 inputs is not rounded).
    """
    return (write_cache_rows(kv_cache, 0, key, slot_mapping),
            write_cache_rows(kv_cache, 1, value, slot_mapping))


def write_cache_rows(kv_cache: torch.Tensor, index: int, x: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """Write new rows of K (index 0), V (1) or an MLA latent (0 of a one-tensor cache) into
    their slots, quantizing for an int8/fp8 cache.

    Args:
        kv_cache: [num_kv, num_blocks, block_size, num_kv_heads, head_size], any cache dtype.
        x: [n, num_kv_heads, head_size] for the n new tokens.
        slot_mapping: [n] int64, block_id * block_size + offset.

    Returns:
        x as the cache now holds it, dequantized, in x's dtype; for an unquantized cache x
        itself.
    """
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache[index].view(-1, num_kv_heads, head_size)
    if not is_quantized_kv_cache(kv_cache):
        flat.index_copy_(0, slot_mapping, x.to(kv_cache.dtype))
        return x
    scales = kv_cache_scales(kv_cache)
    if kv_cache.dtype == torch.int8:
        q, s = quantize_int8(x)
        flat.index_copy_(0, slot_mapping, q)
        scales[index].view(-1, num_kv_heads).index_copy_(0, slot_mapping, s)
        return (q.to(torch.float32) * s[..., None]).to(x.dtype)
    scale = float(scales[index])
    q = quantize_fp8(x, scale)
    # NOTE(kv_quant): torch's CPU index ops do not take float8; the bytes are copied as uint8.
    flat.view(torch.uint8).index_copy_(0, slot_mapping, q.view(torch.uint8))
    return (q.to(torch.float32) * scale).to(x.dtype)


def dequantize_kv(kv_cache: torch.Tensor, index: int, slots: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows of K (index 0) or V (index 1) at `slots`, dequantized.

    Args:
        kv_cache: [num_kv, num_blocks, block_size, num_kv_heads, head_size], any cache dtype.
        slots: [m] int64 slot ids.
        dtype: the result's dtype.

    Returns:
        [m, num_kv_heads, head_size] in `dtype`.
    """
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache[index].view(-1, num_kv_heads, head_size)
    if kv_cache.dtype == torch.float8_e4m3fn:
        rows = flat.view(torch.uint8).index_select(0, slots).view(torch.float8_e4m3fn)
    else:
        rows = flat.index_select(0, slots)
    if not is_quantized_kv_cache(kv_cache):
        return rows.to(dtype)
    scales = kv_cache_scales(kv_cache)
    if kv_cache.dtype == torch.int8:
        s = scales[index].view(-1, num_kv_heads).index_select(0, slots)[..., None]
    else:
        s = scales[index]
    return (rows.to(torch.float32) * s).to(dtype)
