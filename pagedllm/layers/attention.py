"""Attention layer: the model's view of paged attention.

It owns nothing but its shape and the KV-cache tensor bound to it by the worker
(`[2, num_blocks, block_size, num_kv_heads, head_size]`). Each call reads the step's metadata from
the forward context and hands the work to the platform's backend, which writes the new K/V into
their slots and attends over the request's cached context.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.selector import get_attention_backend


class Attention(nn.Module):
    """q [n, H*D], k/v [n, KVH*D] -> out [n, H*D]."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 layer_name: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = layer_name
        self.backend = get_attention_backend()
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        metadata = get_forward_context().attn_metadata
        out = self.backend.forward(q.view(n, self.num_heads, self.head_size),
                                   k.view(n, self.num_kv_heads, self.head_size),
                                   v.view(n, self.num_kv_heads, self.head_size),
                                   self.kv_cache, metadata, self.scale)
        return out.reshape(n, self.num_heads * self.head_size)
