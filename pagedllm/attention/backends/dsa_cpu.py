"""DSA on the CPU: the decode rows' indexer top-k and sparse MLA in the native kernels.

Decode rows (one query token) of a DeepSeek-V3.2 layer run in `csrc/cpu_dsa.cpp`
(native/kernels/dsa.py):

    indexer   dsa_indexer_topk: each row scores its request's cached indexer keys where they
              lie in the paged cache (C8 rows dequantized in-kernel with their per-token
              scale), no gather of the context's keys and no [Q, S] tensor per head; top-k by
              selection (O(S)); a context of at most index_topk tokens is selected whole
              without scoring.
    attention dsa_sparse_mla_decode: absorbed form, q = [W_UK^T q_nope | q_pe] over the K
              selected latents, each read once for all heads; then W_UV on the output.
              int8 / fp8 latent caches gather and dequantize the K selected latents and run
              the torch absorbed form (`dsa_torch.sparse_mla_absorbed`).

Prefill chunks, and every row in the batch-invariant mode, run the torch reference ops
(`dsa_torch.forward_group`, the same code `DSATorchBackend` runs). Metadata is
`MLACpuBackend`'s (the torch row groups plus the decode rows as the kernels take them).
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.dsa_torch import (DSATorchBackend, IndexerInputs,
                                                   forward_group, sparse_mla_absorbed,
                                                   write_caches)
from pagedllm.attention.backends.mla_cpu import MLACpuBackend, MLACpuMetadata
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import dequantize_kv
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.dsa import dsa_indexer_topk, dsa_sparse_mla_decode

_LATENT_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _selected_slots(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """[R, K] cache slots of the rows' selected positions (-1 positions give slot of 0)."""
    pos = positions.clamp(min=0)
    blocks = block_table[rows].to(torch.int64).gather(1, pos // block_size)
    return blocks * block_size + pos % block_size


class DSACpuBackend:
    """DSA with the native kernels for decode rows (module docstring)."""

    name = "dsa_cpu_paged"

    @staticmethod
    def is_available() -> bool:
        return cpu_kernels() is not None

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> MLACpuMetadata:
        return MLACpuBackend.build_metadata(common)

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: MLACpuMetadata, w_kv_b: torch.Tensor,
                scale: float, indexer: IndexerInputs) -> torch.Tensor:
        """As `DSATorchBackend.forward` (same arguments and result; metadata from
        `build_metadata`)."""
        rows = metadata.decode_rows
        if not len(rows):
            return DSATorchBackend.forward(q_nope, q_pe, latent, kv_cache, metadata.sdpa,
                                           w_kv_b, scale, indexer)
        common = metadata.common
        indexer = write_caches(latent, kv_cache, indexer, common)
        num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
        dn = q_nope.shape[-1]
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, dn_dv - dn)

        tokens = metadata.decode_tokens
        positions = dsa_indexer_topk(indexer.q, indexer.weights, indexer.cache,
                                     common.block_table, metadata.seq_lens, rows,
                                     tokens.numpy(), indexer.topk, indexer.scale, checked=False)
        if kv_cache.dtype in _LATENT_KERNEL_DTYPES:
            w_uk, w_uv = w_kv_b.split([dn, dn_dv - dn], dim=1)
            q_lat = torch.einsum("thd,hdl->thl", q_nope[tokens], w_uk)
            q = torch.cat((q_lat, q_pe[tokens]), dim=-1)
            o_lat = dsa_sparse_mla_decode(q, kv_cache, common.block_table, metadata.seq_lens,
                                          rows, positions, kv_lora_rank, scale, checked=False)
            out[tokens] = torch.einsum("thl,hvl->thv", o_lat.to(q_nope.dtype), w_uv)
        else:
            slots = _selected_slots(common.block_table, torch.from_numpy(rows).long(),
                                    positions, kv_cache.shape[2])
            selected = dequantize_kv(kv_cache, 0, slots.reshape(-1), q_nope.dtype)
            out[tokens] = sparse_mla_absorbed(q_nope[tokens], q_pe[tokens],
                                              selected.view(len(rows), -1, kv_cache.shape[-1]),
                                              positions >= 0, w_kv_b, scale)
        for g in metadata.sdpa.groups:
            if g.query_index.shape[1] > 1:
                forward_group(g, q_nope, q_pe, kv_cache, w_kv_b, scale, indexer, out)
        return out
