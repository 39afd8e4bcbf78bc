"""Allocate the per-layer KV tensors and bind them to the model's attention layers.

    kv_cache (one per layer): [2, num_blocks, block_size, num_kv_heads, head_size]
                               K = [0], V = [1]; block 0 is the null block (kept zero).

With several KV cache groups (core/kv_cache_groups.py) each layer's `num_blocks` is its group's.
"""

from __future__ import annotations

import torch

from pagedllm.layers.attention import Attention


def kv_cache_bytes_per_block(layers: list[Attention], block_size: int,
                             dtype: torch.dtype) -> int:
    """Bytes of one block over all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * a.num_kv_heads * a.head_size * elem for a in layers)


def allocate_kv_caches(layers: list[Attention], num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Create one KV tensor per attention layer, zero the null block, bind each to its layer."""
    caches = []
    for layer in layers:
        cache = torch.empty((2, num_blocks, block_size, layer.num_kv_heads, layer.head_size),
                            dtype=dtype, device=device)
        cache[:, 0].zero_()
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
