"""MLA on CUDA: absorbed decode and absorbed prefill in Triton kernels over the paged latent cache.

Per layer and step:

    all new tokens:               their latents [c_kv | k_pe] written to their slots
                                  (`write_cache_rows`: int8 / fp8 quantized there)
    decode rows (query_len == 1): q_lat = W_UK^T q_nope (torch einsum)
                                  -> `mla_decode` (attention/ops/triton_mla_decode.py: all heads
                                     of a request on one latent tile, split-K over long contexts,
                                     int8 / fp8 dequantized in the loop)
                                  -> o_lat [R, H, L] -> W_UV o_lat (torch einsum)
    prefill chunks, absorbed:     q_lat as above -> `mla_prefill` (attention/ops/
                                  triton_mla_prefill.py: tiles of a chunk's tokens x heads on
                                  one latent tile, causal within the chunk) -> W_UV o_lat
    prefill chunks, expanded:     the expanded torch form (`mla_torch.attend_row_groups`:
                                  gathered, dequantized, expanded once per step and layer, SDPA)

A chunk's form is `mla_torch.prefers_absorbed`'s with ABSORBED_COST_FACTOR (short chunks over
long cached prefixes absorbed, fresh prefills expanded), decided on the step's first call for
a layer shape and kept in the metadata. A request's result depends only on its own lengths
(per-request split counts in the decode kernel, per-request tiles in the prefill kernel, a
per-request form), so the batch-invariant mode needs nothing of its own. CUDA graphs are not
declared: prefill rows need host-side groups and tiles, and every MLA model here has a fused
MoE layer, which keeps graphs off anyway.

On CPU tensors the kernels run only in triton's interpreter (`TRITON_INTERPRET=1` when triton
and the kernel modules are imported): tests use that; nothing here has run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.backends.mla_torch import (absorbed_rows_mask, attend_row_groups,
                                                    check_prefill_form)
from pagedllm.attention.backends.torch_sdpa import build_row_group
from pagedllm.attention.backends.triton_paged import TritonPagedBackend
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import is_quantized_kv_cache, kv_cache_scales, write_cache_rows


# Cost per multiply-add of the absorbed prefill kernel relative to the expanded form's torch
# GEMMs (`mla_torch.prefers_absorbed`). NOTE(gpu): not measured (no GPU where this was built):
# 1.0 counts multiply-adds alone.
ABSORBED_COST_FACTOR = 1.0


@dataclass(frozen=True)
class MLATritonStepSplit:
    """A step's prefill rows split between the Triton prefill kernel and the expanded form, for
    one layer shape.

    Attributes:
        kernel_tokens: [T] int64 on the device, the absorbed chunks' tokens in tile order.
        tiles: [4, num_tiles] int32 on the device (`triton_mla_prefill.plan_query_tiles`).
        block_q, block_h: the kernel's tokens and heads per program.
        expanded_groups: torch_sdpa row groups of the chunks run expanded (none or one).
    """

    kernel_tokens: torch.Tensor
    tiles: torch.Tensor
    block_q: int
    block_h: int
    expanded_groups: tuple


@dataclass(frozen=True)
class MLATritonMetadata:
    """Per-step inputs, built once and shared by all layers.

    Attributes:
        common: the step's metadata.
        decode_reqs: [R] int32 on the device, the requests with one query token.
        decode_tokens: [R] int64 on the device, their token indices.
        max_decode_seq_len: the longest of those requests (host int; sizes the split grid).
        prefill_rows: [P] int64 numpy, the requests with several query tokens.
        prefill_form: one of `mla_torch.PREFILL_FORMS`.
        splits: `MLATritonStepSplit` per layer shape (dn, dr, dv, L, H), made on the first
            call of each shape (`split`).
    """

    common: CommonAttentionMetadata
    decode_reqs: torch.Tensor
    decode_tokens: torch.Tensor
    max_decode_seq_len: int
    prefill_rows: np.ndarray
    prefill_form: str = "auto"
    splits: dict = field(default_factory=dict)

    def split(self, dims: tuple[int, int, int, int, int]) -> MLATritonStepSplit:
        """The split of this step's prefill rows for a layer of dimensions (dn, dr, dv, L, H)."""
        from pagedllm.attention.ops import triton_mla_prefill

        found = self.splits.get(dims)
        if found is not None:
            return found
        common = self.common
        qsl = common.query_start_loc_cpu[:common.num_reqs + 1]
        seq_lens = common.seq_lens_cpu[:common.num_reqs]
        rows = self.prefill_rows
        absorbed = absorbed_rows_mask(np.diff(qsl)[rows], seq_lens[rows], dims[:4],
                                      self.prefill_form, ABSORBED_COST_FACTOR)
        kernel_rows, expanded = rows[absorbed], rows[~absorbed]
        block_q, block_h = triton_mla_prefill.query_block(dims[4])
        device = common.seq_lens.device
        tokens = (np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in kernel_rows])
                  if len(kernel_rows) else np.zeros(0))
        tiles = triton_mla_prefill.plan_query_tiles(qsl, seq_lens, kernel_rows, block_q)
        found = MLATritonStepSplit(
            torch.from_numpy(tokens.astype(np.int64)).to(device),
            torch.from_numpy(tiles).to(device), block_q, block_h,
            (build_row_group(common, expanded),) if len(expanded) else ())
        self.splits[dims] = found
        return found


class MLATritonBackend:
    """MLA with the Triton absorbed kernels (module docstring)."""

    name = "mla_triton"

    is_available = staticmethod(TritonPagedBackend.is_available)
    unavailable_reason = staticmethod(TritonPagedBackend.unavailable_reason)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata,
                       prefill_form: str = "auto") -> MLATritonMetadata:
        """The step's decode rows and prefill rows; the prefill rows' split between the forms
        is made per layer shape (`MLATritonMetadata.split`).

        Args:
            common: the step's metadata.
            prefill_form: one of `mla_torch.PREFILL_FORMS` (tests force a form).

        Raises:
            ValueError: for another prefill_form.
        """
        check_prefill_form(MLATritonBackend.name, prefill_form)
        qsl = common.query_start_loc_cpu[:common.num_reqs + 1]
        seq_lens = common.seq_lens_cpu[:common.num_reqs]
        is_decode = np.diff(qsl) == 1
        decode_rows, prefill_rows = np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]
        device = common.seq_lens.device
        return MLATritonMetadata(
            common=common,
            decode_reqs=torch.from_numpy(decode_rows.astype(np.int32)).to(device),
            decode_tokens=torch.from_numpy(qsl[decode_rows].astype(np.int64)).to(device),
            max_decode_seq_len=int(seq_lens[decode_rows].max()) if len(decode_rows) else 0,
            prefill_rows=prefill_rows, prefill_form=prefill_form)

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: MLATritonMetadata, w_kv_b: torch.Tensor,
                scale: float) -> torch.Tensor:
        """As `MLATorchBackend.forward` (same arguments and result).

        Raises:
            ValueError: for CPU tensors when the kernel modules were not imported under
                TRITON_INTERPRET=1, or inputs the kernels do not take (see `mla_decode`,
                `mla_prefill`).
        """
        from pagedllm.attention.ops import triton_mla_decode, triton_mla_prefill

        if q_nope.device.type == "cpu" and not (triton_mla_decode.INTERPRETED
                                                and triton_mla_prefill.INTERPRETED):
            raise ValueError("mla_triton: CPU tensors need triton's interpreter "
                             "(TRITON_INTERPRET=1 set before triton is imported); use "
                             "mla_cpu_paged or mla_torch on the CPU")
        common = metadata.common
        n = common.num_actual_tokens
        write_cache_rows(kv_cache, 0, latent[:n, None], common.slot_mapping[:n])
        num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
        dn = q_nope.shape[-1]
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, dn_dv - dn)
        w_uk, w_uv = w_kv_b.split([dn, dn_dv - dn], dim=1)         # [H, dn, L], [H, dv, L]
        scales = kv_cache_scales(kv_cache) if is_quantized_kv_cache(kv_cache) else None

        tokens = metadata.decode_tokens
        if len(tokens):
            q_lat = torch.einsum("thd,hdl->thl", q_nope[tokens], w_uk)
            o_lat = triton_mla_decode.mla_decode(
                q_lat, q_pe[tokens].contiguous(), kv_cache, common.block_table,
                common.seq_lens, metadata.decode_reqs, scale, metadata.max_decode_seq_len,
                scales=scales)
            out[tokens] = torch.einsum("thl,hvl->thv", o_lat, w_uv)
        if not len(metadata.prefill_rows):
            return out
        split = metadata.split((dn, q_pe.shape[-1], dn_dv - dn, kv_lora_rank, num_heads))
        tokens = split.kernel_tokens
        if len(tokens):
            q_lat = torch.einsum("thd,hdl->thl", q_nope[tokens], w_uk)
            o_lat = triton_mla_prefill.mla_prefill(
                q_lat, q_pe[tokens].contiguous(), kv_cache, common.block_table, split.tiles,
                split.block_q, split.block_h, scale, scales=scales)
            out[tokens] = torch.einsum("thl,hvl->thv", o_lat, w_uv)
        attend_row_groups(out, split.expanded_groups, q_nope, q_pe, kv_cache, w_kv_b, scale)
        return out
