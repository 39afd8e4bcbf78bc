"""DSA on the CPU: every query token's indexer top-k and sparse MLA in the native kernels.

Each query token of a DeepSeek-V3.2 layer, decode row or prefill chunk token alike, is one row
of the kernels in `csrc/cpu_dsa.cpp` (native/kernels/dsa.py):

    indexer   dsa_indexer_topk: each row scores its request's cached indexer keys where they
              lie in the paged cache (C8 rows dequantized in-kernel with their per-token
              scale), no gather of the context's keys and no [Q, S] tensor per head; top-k by
              selection (O(S)); a context of at most index_topk tokens is selected whole
              without scoring.
    attention dsa_sparse_mla_decode: absorbed form, q = [W_UK^T q_nope | q_pe] over the K
              selected latents, each read once for all heads; then W_UV on the output.
              int8 / fp8 latent caches gather and dequantize the K selected latents and run
              the torch absorbed form (`dsa_torch.sparse_mla_absorbed`).

The kernels take a row's context as positions 0 .. seq_len - 1 of its request: a decode row
is its request (seq_len the request's); a prefill chunk's token at position p is a row of
seq_len p + 1 over its request's block table (the table's row repeated by a stride-0 view, so
causal masking costs nothing). Prefill chunks go `_PREFILL_ROWS` tokens per kernel call. The
batch-invariant mode, and steps whose queries attend past their position (`attend_until`),
run every row in the torch reference ops (`DSATorchBackend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backends.dsa_torch import (DSATorchBackend, IndexerInputs,
                                                   sparse_mla_absorbed, write_caches)
from pagedllm.attention.backends.torch_sdpa import TorchSDPAMetadata
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import dequantize_kv
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.dsa import dsa_indexer_topk, dsa_sparse_mla_decode

_LATENT_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Prefill tokens per kernel call (bounds the [rows, index_topk] positions held at once).
_PREFILL_ROWS = 1024


@dataclass(frozen=True)
class DSACpuMetadata:
    """Per-step kernel inputs, shared by all layers.

    Attributes:
        common: the step's metadata.
        torch_metadata: row groups of every request when the torch ops run the step
            (batch-invariant mode, `attend_until`), else None.
        seq_lens: [num_reqs] int32 numpy.
        decode_rows: [R] int32 numpy, the requests with one query token.
        decode_tokens: [R] int64, their token indices.
        prefills: (request, tokens [Q] int64, seq_lens [Q] int32 numpy: position + 1) per
            prefill chunk slice of at most _PREFILL_ROWS tokens.
    """

    common: CommonAttentionMetadata
    torch_metadata: TorchSDPAMetadata | None
    seq_lens: np.ndarray
    decode_rows: np.ndarray
    decode_tokens: torch.Tensor
    prefills: tuple


def _selected_slots(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """[R, K] cache slots of the rows' selected positions (-1 positions give slot of 0)."""
    pos = positions.clamp(min=0)
    blocks = block_table[rows].to(torch.int64).gather(1, pos // block_size)
    return blocks * block_size + pos % block_size


class DSACpuBackend:
    """DSA with the native kernels for every query token (module docstring)."""

    name = "dsa_cpu_paged"

    @staticmethod
    def is_available() -> bool:
        return cpu_kernels() is not None

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> DSACpuMetadata:
        """The step's rows as the kernels take them (module docstring)."""
        qsl = np.asarray(common.query_start_loc_cpu[:common.num_reqs + 1], dtype=np.int64)
        seq_lens = np.ascontiguousarray(common.seq_lens_cpu[:common.num_reqs], dtype=np.int32)
        if common.batch_invariant or common.attend_until is not None:
            return DSACpuMetadata(common, DSATorchBackend.build_metadata(common), seq_lens,
                                  np.zeros(0, np.int32), torch.zeros(0, dtype=torch.int64), ())
        query_lens = np.diff(qsl)
        decode_rows = np.nonzero(query_lens == 1)[0].astype(np.int32)
        prefills = []
        for r in np.nonzero(query_lens > 1)[0]:
            first = int(seq_lens[r]) - int(query_lens[r])   # the chunk's first position
            for start in range(0, int(query_lens[r]), _PREFILL_ROWS):
                n = min(_PREFILL_ROWS, int(query_lens[r]) - start)
                prefills.append((int(r), torch.arange(qsl[r] + start, qsl[r] + start + n),
                                 np.arange(first + start + 1, first + start + n + 1,
                                           dtype=np.int32)))
        return DSACpuMetadata(common, None, seq_lens, decode_rows,
                              torch.from_numpy(qsl[decode_rows]), tuple(prefills))

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: DSACpuMetadata, w_kv_b: torch.Tensor,
                scale: float, indexer: IndexerInputs) -> torch.Tensor:
        """As `DSATorchBackend.forward` (same arguments and result; metadata from
        `build_metadata`)."""
        if metadata.torch_metadata is not None:
            return DSATorchBackend.forward(q_nope, q_pe, latent, kv_cache,
                                           metadata.torch_metadata, w_kv_b, scale, indexer)
        common = metadata.common
        indexer = write_caches(latent, kv_cache, indexer, common)
        num_heads, dn_dv, _ = w_kv_b.shape
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, dn_dv - q_nope.shape[-1])
        if len(metadata.decode_rows):
            out[metadata.decode_tokens] = _attend_rows(
                q_nope, q_pe, kv_cache, w_kv_b, scale, indexer, common.block_table,
                metadata.seq_lens, metadata.decode_rows, metadata.decode_tokens)
        for request, tokens, seq_lens in metadata.prefills:
            # one kernel row per token: its request's block table row, repeated (stride 0)
            table = common.block_table[request:request + 1].expand(len(tokens), -1)
            out[tokens] = _attend_rows(q_nope, q_pe, kv_cache, w_kv_b, scale, indexer, table,
                                       seq_lens, np.arange(len(tokens), dtype=np.int32), tokens)
        return out


def _attend_rows(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                 w_kv_b: torch.Tensor, scale: float, indexer: IndexerInputs,
                 block_table: torch.Tensor, seq_lens: np.ndarray, rows: np.ndarray,
                 tokens: torch.Tensor) -> torch.Tensor:
    """DSA of kernel rows `rows` (indices into block_table and seq_lens; query tokens
    `tokens` [R] int64): indexer top-k, then sparse MLA. Returns [R, H, dv] in q_nope's
    dtype."""
    dn = q_nope.shape[-1]
    dn_dv, kv_lora_rank = w_kv_b.shape[1:]
    positions = dsa_indexer_topk(indexer.q, indexer.weights, indexer.cache, block_table,
                                 seq_lens, rows, tokens.numpy(), indexer.topk, indexer.scale,
                                 checked=False)
    if kv_cache.dtype in _LATENT_KERNEL_DTYPES:
        w_uk, w_uv = w_kv_b.split([dn, dn_dv - dn], dim=1)
        q_lat = torch.einsum("thd,hdl->thl", q_nope[tokens], w_uk)
        q = torch.cat((q_lat, q_pe[tokens]), dim=-1)
        o_lat = dsa_sparse_mla_decode(q, kv_cache, block_table, seq_lens, rows, positions,
                                      kv_lora_rank, scale, checked=False)
        return torch.einsum("thl,hvl->thv", o_lat.to(q_nope.dtype), w_uv)
    slots = _selected_slots(block_table, torch.from_numpy(rows).long(), positions,
                            kv_cache.shape[2])
    selected = dequantize_kv(kv_cache, 0, slots.reshape(-1), q_nope.dtype)
    return sparse_mla_absorbed(q_nope[tokens], q_pe[tokens],
                               selected.view(len(rows), -1, kv_cache.shape[-1]),
                               positions >= 0, w_kv_b, scale)
