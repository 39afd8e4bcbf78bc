"""Allocate the per-layer KV tensors and bind them to the model's attention layers.

    kv_cache (one per layer): [2, num_blocks, block_size, num_kv_heads, head_size]
                               K = [0], V = [1]; block 0 is the null block (kept zero).

    MLA layers (layers/mla_attention.py): one latent tensor instead of K and V,
    [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] (`num_kv_tensors` = 1).

    DSA indexer caches (layers/sparse_mla_attention.py `IndexerKCache`, one beside each
    DeepSeek-V3.2 latent cache): [1, num_blocks, block_size, 1, index_head_dim (+ 4 in C8)] in
    the indexer cache dtype (`indexer_cache_dtype`; layout in indexer_cache_layout.py).

With several KV cache groups (core/kv_cache_groups.py) each layer's `num_blocks` is its group's.
The cache dtype is the model's, or int8 / float8_e4m3fn (`kv_cache_dtype`), whose scales live in
the same allocation after the K/V (layout in kv_cache_layout.py).
"""

from __future__ import annotations

import torch

from pagedllm.indexer_cache_layout import allocate_indexer_cache, indexer_cache_bytes_per_token
from pagedllm.kv_cache_layout import (allocate_kv_cache, kv_cache_block_bytes,
                                      resolve_kv_cache_dtype)
from pagedllm.layers.attention import Attention
from pagedllm.layers.sparse_mla_attention import IndexerKCache

__all__ = ["allocate_kv_caches", "describe_kv_bytes_per_token", "kv_cache_bytes_per_block",
           "kv_cache_layer_groups", "resolve_kv_cache_dtype"]


def kv_cache_bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype,
                             indexer_dtype: torch.dtype | None = None) -> int:
    """Bytes of one block over all layers (K and V, and an int8 cache's per-token scales; a DSA
    indexer cache's keys and C8 scales); `dtype` is the cache dtype (see
    `resolve_kv_cache_dtype`), `indexer_dtype` the indexer caches' (None: `dtype`)."""
    return sum(block_size * indexer_cache_bytes_per_token(a.head_size, indexer_dtype or dtype)
               if isinstance(a, IndexerKCache) else
               kv_cache_block_bytes(block_size, a.num_kv_heads, a.head_size, dtype,
                                    a.num_kv_tensors)
               for a in layers)


def describe_kv_bytes_per_token(layers: list[Attention], dtype: torch.dtype,
                                indexer_dtype: torch.dtype | None = None) -> str:
    """'N bytes per token' of the cache over `layers`, with the formula for MLA latent layers
    ('= layers x (kv_lora_rank + qk_rope_head_dim) x bytes per value', + int8's 4-byte scale),
    and DSA indexer caches ('+ layers x index_head_dim x bytes per value', + C8's scale)."""
    per_token = kv_cache_bytes_per_block(layers, 1, dtype, indexer_dtype)
    text = f"{per_token} bytes per token"
    indexers = [a for a in layers if isinstance(a, IndexerKCache)]
    latent = [a for a in layers if a.num_kv_tensors == 1 and not isinstance(a, IndexerKCache)]
    if (latent and len(latent) + len(indexers) == len(layers)
            and len({a.head_size for a in latent}) == 1
            and len({a.head_size for a in indexers}) <= 1):
        a = latent[0]
        elem = torch.empty((), dtype=dtype).element_size()
        scale = " + a 4-byte scale" if dtype == torch.int8 else ""
        text += (f" = {len(latent)} MLA layers x ({a.kv_lora_rank} + {a.qk_rope_head_dim} latent "
                 f"values x {elem} bytes{scale})")
        if indexers:
            idx_dtype = indexer_dtype or dtype
            idx_bytes = indexer_cache_bytes_per_token(indexers[0].head_size, idx_dtype)
            elem = torch.empty((), dtype=idx_dtype).element_size()
            scale = "" if idx_bytes == indexers[0].head_size * elem else " + a 4-byte scale"
            text += (f" + {len(indexers)} indexer layers x ({indexers[0].head_size} key values "
                     f"x {elem} bytes{scale})")
    return text


def allocate_kv_caches(layers: list[Attention], num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device,
                       indexer_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Create one KV tensor per attention layer in the cache dtype `dtype` (int8/fp8 with their
    scales; DSA indexer caches in `indexer_dtype`, None: `dtype`), zero the null block, bind
    each to its layer."""
    caches = []
    for layer in layers:
        if isinstance(layer, IndexerKCache):
            cache = allocate_indexer_cache(num_blocks, block_size, layer.head_size,
                                           indexer_dtype or dtype, device)
        else:
            cache = allocate_kv_cache(num_blocks, block_size, layer.num_kv_heads,
                                      layer.head_size, dtype, device, layer.num_kv_tensors)
        layer.kv_cache = cache
        caches.append(cache)
    return caches


def kv_cache_layer_groups(layers: list[Attention],
                          windows: tuple[int | None, ...]) -> list[list[Attention]]:
    """The layers of each KV cache group: group g holds the layers whose `sliding_window` is
    windows[g]; with one group, every layer (whatever its window).

    Raises:
        ValueError: if a layer's window is not among `windows`.
    """
    if len(windows) == 1:
        return [list(layers)]
    unknown = {a.sliding_window for a in layers} - set(windows)
    if unknown:
        raise ValueError(f"layers with sliding windows {unknown} have no KV cache group "
                         f"(groups: {windows})")
    return [[a for a in layers if a.sliding_window == w] for w in windows]
