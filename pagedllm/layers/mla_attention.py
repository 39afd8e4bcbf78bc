"""MLA attention layer: the model's view of Multi-head Latent Attention over a latent cache.

Like `layers/attention.py` it owns nothing but its shape and the cache tensor the worker binds
to it, here one latent vector per token (kv_lora_rank + qk_rope_head_dim values, shared by all
heads) instead of per-head K and V:

    kv_cache: [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
              (the K/V layout of kv_cache_layout.py with one tensor and one "head", so the
              int8/fp8 cache dtypes and their scales apply unchanged; `latent_cache` is the
              [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] view)

Each call reads the step's metadata from the forward context (the second reader besides
`layers/attention.py`, for the same reason: a layer needs its step's metadata) and hands the
work to the MLA backend (`get_mla_attention_backend`: mla_cpu_paged, whose decode rows and
short prefill chunks run absorbed in the native kernel, mla_triton, whose absorbed rows run in
Triton kernels, or the torch reference mla_torch), which picks the expanded or absorbed form
per request (`mla_torch.prefers_absorbed`) or row group. Block accounting is full attention's: one slot per position.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backends.selector import get_mla_attention_backend
from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.metadata import KVCacheGroupsMetadata


class MLAAttention(nn.Module):
    """(q_nope [n, H, dn], q_pe [n, H, dr], latent [n, L + dr], w_kv_b [H, dn + dv, L])
    -> out [n, H * dv].

    Args:
        num_heads: this rank's query heads (H).
        kv_lora_rank: L, the compressed KV size.
        qk_rope_head_dim: dr, the RoPE part of each key (shared by the heads, cached).
        scale: softmax scale.
        layer_name: for messages.

    Attributes read by the worker (the KV cache shape, as `Attention`'s): num_kv_heads = 1,
    head_size = L + dr, num_kv_tensors = 1, sliding_window None.
    """

    num_kv_tensors = 1
    num_kv_heads = 1
    sliding_window = None
    logits_soft_cap = None

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float,
                 layer_name: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.head_size = kv_lora_rank + qk_rope_head_dim
        self.scale = scale
        self.layer_name = layer_name
        self.backend = get_mla_attention_backend()
        self.kv_cache = torch.empty(0)

    @property
    def latent_cache(self) -> torch.Tensor:
        """[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] view of the cache."""
        return self.kv_cache[0, :, :, 0]

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                w_kv_b: torch.Tensor) -> torch.Tensor:
        n = q_nope.shape[0]
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, KVCacheGroupsMetadata):
            metadata = metadata.for_layer(None)
        out = self.backend.forward(q_nope, q_pe, latent, self.kv_cache, metadata, w_kv_b,
                                   self.scale)
        return out.reshape(n, -1)
