"""DSA attention layers (DeepSeek-V3.2): the lightning indexer's K cache as a cache layer of its
own, and MLA restricted to the indexer's top-k tokens.

    IndexerKCache       one key of index_head_dim values per token (indexer_cache_layout.py),
                        a "layer" of the model's `attention_layers()` as vLLM's
                        `DeepseekV32IndexerCache`: the worker sizes, allocates and binds its
                        tensor beside the latent cache, in the same KV cache group, so it shares
                        the block table (slot ids), prefix caching and preemption, and its bytes
                        count in the bytes per block.
    SparseMLAAttention  `MLAAttention` whose softmax covers only the selected tokens
                        (attention/backends/dsa_torch.py; on the CPU every query token runs in
                        the native kernels, dsa_cpu.py); it writes both caches.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backends.dsa_torch import DSATorchBackend, IndexerInputs
from pagedllm.attention.backends.selector import get_dsa_attention_backend
from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.metadata import KVCacheGroupsMetadata
from pagedllm.layers.mla_attention import MLAAttention


class IndexerKCache(nn.Module):
    """The indexer key cache of one DSA layer: no computation, only the tensor the worker binds
    (`kv_cache`, [1, num_blocks, block_size, 1, D] or D + 4 in C8) and its shape attributes.

    Args:
        head_dim: index_head_dim (D).
        layer_name: unique, for messages and KV transfer (`...self_attn.indexer.k_cache`).
    """

    num_kv_tensors = 1
    num_kv_heads = 1
    num_heads = 1
    sliding_window = None
    logits_soft_cap = None
    backend = DSATorchBackend

    def __init__(self, head_dim: int, layer_name: str) -> None:
        super().__init__()
        self.head_size = head_dim
        self.layer_name = layer_name
        self.kv_cache = torch.empty(0)


class SparseMLAAttention(MLAAttention):
    """MLA over the indexer's top-k tokens of each query:
    (q_nope [n, H, dn], q_pe [n, H, dr], latent [n, L + dr], w_kv_b [H, dn + dv, L],
    index_q [n, Hi, D], index_k [n, D], index_weights [n, Hi] float32) -> [n, H * dv].

    Args:
        as `MLAAttention`, and index_head_dim (D), index_topk, and the indexer's score scale
        (D^-0.5). The indexer cache is `indexer_cache` (an `IndexerKCache`).
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float,
                 layer_name: str, index_head_dim: int, index_topk: int) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, scale, layer_name)
        self.backend = get_dsa_attention_backend()
        self.index_topk = index_topk
        self.index_scale = index_head_dim ** -0.5
        self.indexer_cache = IndexerKCache(index_head_dim, f"{layer_name}.indexer.k_cache")

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                w_kv_b: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
                index_weights: torch.Tensor) -> torch.Tensor:
        n = q_nope.shape[0]
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, KVCacheGroupsMetadata):
            metadata = metadata.for_layer(None)
        indexer = IndexerInputs(index_q, index_k, index_weights, self.indexer_cache.kv_cache,
                                self.index_scale, self.index_topk)
        out = self.backend.forward(q_nope, q_pe, latent, self.kv_cache, metadata, w_kv_b,
                                   self.scale, indexer)
        return out.reshape(n, -1)
