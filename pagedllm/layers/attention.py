"""Attention layer: the model's view of paged attention.

It owns nothing but its shape and the KV-cache tensor bound to it by the worker
(`[2, num_blocks, block_size, num_kv_heads, head_size]`). Each call reads the step's metadata from
the forward context and hands the work to the platform's backend, which writes the new K/V into
their slots and attends over the request's cached context. Per-layer variants (a sliding window,
attention-logit soft-capping) are facts of the layer, passed to the backend with every call.
With a KV connector, the layer waits for its own loaded blocks before attending and hands its
cache to the connector's saves right after writing it (the forward context's `kv_hooks`), so
transfers of the other layers overlap its compute (vLLM's per-layer connector calls).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.metadata import KVCacheGroupsMetadata
from pagedllm.attention.backends.selector import get_attention_backend


class Attention(nn.Module):
    """q [n, H*D], k/v [n, KVH*D] -> out [n, H*D].

    Args:
        scale: softmax scale applied to q.k (usually head_size ** -0.5).
        sliding_window: a query at position p sees only key positions > p - sliding_window (its
            last `sliding_window` positions, itself included; HF's sliding-window mask); None =
            the whole causal context.
        logits_soft_cap: scaled scores s become cap * tanh(s / cap) before the softmax (Gemma 2);
            None = no capping.

    Raises:
        ValueError: for a sliding_window < 1 or a logits_soft_cap <= 0.
    """

    # Tensors of the layer's KV cache (K and V; an MLA layer's latent cache has one).
    num_kv_tensors = 2

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 layer_name: str, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{layer_name}: sliding_window must be >= 1, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"{layer_name}: logits_soft_cap must be > 0, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = layer_name
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.backend = get_attention_backend()
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        context = get_forward_context()
        metadata, hooks = context.attn_metadata, context.kv_hooks
        if hooks is not None:   # (a KV connector: this layer's loads must have landed)
            hooks.wait_for_layer_load(self.layer_name)
        if isinstance(metadata, KVCacheGroupsMetadata):   # several block tables: take ours
            metadata = metadata.for_layer(self.sliding_window)
        out = self.backend.forward(q.view(n, self.num_heads, self.head_size),
                                   k.view(n, self.num_kv_heads, self.head_size),
                                   v.view(n, self.num_kv_heads, self.head_size),
                                   self.kv_cache, metadata, self.scale,
                                   sliding_window=self.sliding_window,
                                   logits_soft_cap=self.logits_soft_cap)
        if hooks is not None:   # (the step's K/V of this layer are written: saves may start)
            hooks.save_kv_layer(self.layer_name, self.kv_cache)
        return out.reshape(n, self.num_heads * self.head_size)
