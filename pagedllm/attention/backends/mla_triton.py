"""MLA on CUDA: absorbed decode in a Triton kernel over the paged latent cache.

Per layer and step:

    all new tokens:               their latents [c_kv | k_pe] written to their slots
                                  (`write_cache_rows`: int8 / fp8 quantized there)
    decode rows (query_len == 1): q_lat = W_UK^T q_nope (torch einsum)
                                  -> `mla_decode` (attention/ops/triton_mla_decode.py: all heads
                                     of a request on one latent tile, split-K over long contexts,
                                     int8 / fp8 dequantized in the loop)
                                  -> o_lat [R, H, L] -> W_UV o_lat (torch einsum)
    other rows (prefill chunks):  the expanded torch form, as `MLATorchBackend` (gathered,
                                  dequantized, expanded once per step and layer, SDPA)

Prefill stays on the torch path: it is compute-bound and already shares one expansion of the
context among a chunk's queries; a Triton kernel for it (FlashAttention over the expanded K/V,
or absorbed prefill for short chunks over long contexts) is not built. A request's decode result
depends only on its own length (the kernel's split count is per request), so the batch-invariant
mode needs nothing of its own. CUDA graphs are not declared: prefill rows need host-side
groups, and every MLA model here has a fused MoE layer, which keeps graphs off anyway.

On CPU tensors the kernel runs only in triton's interpreter (`TRITON_INTERPRET=1` when triton
and the kernel module are imported): tests use that; nothing here has run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backends.mla_torch import attend_row_groups
from pagedllm.attention.backends.torch_sdpa import build_row_group
from pagedllm.attention.backends.triton_paged import TritonPagedBackend
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import is_quantized_kv_cache, kv_cache_scales, write_cache_rows


@dataclass(frozen=True)
class MLATritonMetadata:
    """Per-step inputs, built once and shared by all layers.

    Attributes:
        common: the step's metadata.
        prefill_groups: torch_sdpa row groups of the rows with query_len > 1 (none or one).
        decode_reqs: [R] int32 on the device, the requests with one query token.
        decode_tokens: [R] int64 on the device, their token indices.
        max_decode_seq_len: the longest of those requests (host int; sizes the split grid).
    """

    common: CommonAttentionMetadata
    prefill_groups: tuple
    decode_reqs: torch.Tensor
    decode_tokens: torch.Tensor
    max_decode_seq_len: int


class MLATritonBackend:
    """MLA with the Triton absorbed-decode kernel (module docstring)."""

    name = "mla_triton"

    is_available = staticmethod(TritonPagedBackend.is_available)
    unavailable_reason = staticmethod(TritonPagedBackend.unavailable_reason)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> MLATritonMetadata:
        qsl = common.query_start_loc_cpu[:common.num_reqs + 1]
        seq_lens = common.seq_lens_cpu[:common.num_reqs]
        is_decode = np.diff(qsl) == 1
        decode_rows, prefill_rows = np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]
        device = common.seq_lens.device
        groups = (build_row_group(common, prefill_rows),) if len(prefill_rows) else ()
        return MLATritonMetadata(
            common=common, prefill_groups=groups,
            decode_reqs=torch.from_numpy(decode_rows.astype(np.int32)).to(device),
            decode_tokens=torch.from_numpy(qsl[decode_rows].astype(np.int64)).to(device),
            max_decode_seq_len=int(seq_lens[decode_rows].max()) if len(decode_rows) else 0)

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: MLATritonMetadata, w_kv_b: torch.Tensor,
                scale: float) -> torch.Tensor:
        """As `MLATorchBackend.forward` (same arguments and result).

        Raises:
            ValueError: for CPU tensors when the kernel module was not imported under
                TRITON_INTERPRET=1, or inputs the kernel does not take (see `mla_decode`).
        """
        from pagedllm.attention.ops import triton_mla_decode

        if q_nope.device.type == "cpu" and not triton_mla_decode.INTERPRETED:
            raise ValueError("mla_triton: CPU tensors need triton's interpreter "
                             "(TRITON_INTERPRET=1 set before triton is imported); use "
                             "mla_cpu_paged or mla_torch on the CPU")
        common = metadata.common
        n = common.num_actual_tokens
        write_cache_rows(kv_cache, 0, latent[:n, None], common.slot_mapping[:n])
        num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
        dn = q_nope.shape[-1]
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, dn_dv - dn)

        tokens = metadata.decode_tokens
        if len(tokens):
            w_uk, w_uv = w_kv_b.split([dn, dn_dv - dn], dim=1)     # [H, dn, L], [H, dv, L]
            q_lat = torch.einsum("thd,hdl->thl", q_nope[tokens], w_uk)
            o_lat = triton_mla_decode.mla_decode(
                q_lat, q_pe[tokens].contiguous(), kv_cache, common.block_table,
                common.seq_lens, metadata.decode_reqs, scale, metadata.max_decode_seq_len,
                scales=kv_cache_scales(kv_cache) if is_quantized_kv_cache(kv_cache) else None)
            out[tokens] = torch.einsum("thl,hvl->thv", o_lat, w_uv)
        attend_row_groups(out, metadata.prefill_groups, q_nope, q_pe, kv_cache, w_kv_b, scale)
        return out
