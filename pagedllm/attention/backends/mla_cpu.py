"""MLA on the CPU: absorbed decode through the native paged-attention kernel.

In the absorbed form (attention/backends/mla_torch.py) a decode row's H query heads attend over
the request's latents as one shared KV head of size L + dr, with the latents' first L values as
the values. That is multi-query attention whose key and value caches are the same tensor, so
the native paged kernel (`csrc/cpu_attention.cpp`, the one `CpuPagedBackend` uses) runs it
unchanged: key_cache = value_cache = the latent cache, num_kv_heads 1, head_size L + dr. The
kernel walks the block table and reads each latent row where it lies, once per token for all
heads (no gather into a padded copy, no expansion); its output's last dr channels (the "values"
of k_pe) are dropped. The cost of the extra dr channels is dr / (L + dr) of the value work
(11% at DeepSeek's 512 + 64).

    decode rows (query_len == 1):  q = [W_UK^T q_nope | q_pe] [n, H, L + dr] -> kernel
                                   -> o_lat = out[..., :L] -> W_UV o_lat
    other rows (prefill chunks):   the torch expanded form, as `MLATorchBackend`

Used for float32 / bfloat16 latent caches when the kernel library is built; int8 / fp8 latent
caches (whose scales the kernel would read per K and V tensor) and the batch-invariant mode run
every row through `MLATorchBackend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backends.mla_torch import MLATorchBackend, mla_attention_expanded
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import dequantize_kv, write_cache_rows
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.ops import paged_attention

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class MLACpuMetadata:
    """Per-step inputs, built once and shared by all layers.

    Attributes:
        sdpa: the torch row groups (`MLATorchBackend.build_metadata`), for the prefill rows and
            for the fallback.
        query_start_loc, seq_lens: [num_reqs + 1] / [num_reqs] int32 numpy (kernel inputs).
        decode_rows: [R] int32 numpy, the requests with one query token (the kernel's).
        decode_tokens: [R] int64 on the device, their token indices.
    """

    sdpa: TorchSDPAMetadata
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    decode_rows: np.ndarray
    decode_tokens: torch.Tensor

    @property
    def common(self) -> CommonAttentionMetadata:
        return self.sdpa.common


class MLACpuBackend:
    """MLA with the native kernel for decode rows (module docstring)."""

    name = "mla_cpu_paged"

    @staticmethod
    def is_available() -> bool:
        return cpu_kernels() is not None

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> MLACpuMetadata:
        qsl = np.ascontiguousarray(common.query_start_loc_cpu[:common.num_reqs + 1],
                                   dtype=np.int32)
        seq_lens = np.ascontiguousarray(common.seq_lens_cpu[:common.num_reqs], dtype=np.int32)
        decode = (np.diff(qsl) == 1) & (not common.batch_invariant)
        rows = np.nonzero(decode)[0].astype(np.int32)
        return MLACpuMetadata(TorchSDPABackend.build_metadata(common), qsl, seq_lens, rows,
                              torch.from_numpy(qsl[rows].astype(np.int64)))

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: MLACpuMetadata, w_kv_b: torch.Tensor,
                scale: float) -> torch.Tensor:
        """As `MLATorchBackend.forward` (same arguments and result)."""
        if kv_cache.dtype not in _KERNEL_DTYPES or not len(metadata.decode_rows):
            return MLATorchBackend.forward(q_nope, q_pe, latent, kv_cache, metadata.sdpa,
                                           w_kv_b, scale)
        common = metadata.common
        n = common.num_actual_tokens
        latent_size = kv_cache.shape[-1]
        write_cache_rows(kv_cache, 0, latent[:n, None], common.slot_mapping[:n])
        num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
        dn = q_nope.shape[-1]

        w_uk, w_uv = w_kv_b.split([dn, dn_dv - dn], dim=1)
        # Key and value caches are the same latent tensor (stride 0 over the K/V axis).
        one = kv_cache[0]
        kv = one.as_strided((2,) + tuple(one.shape), (0,) + one.stride())
        if len(metadata.decode_rows) == q_nope.shape[0] == n:
            # Every row is a decode row (token t is request t's): no gathers or scatters.
            # NOTE(mla): per-head products as bmm over [H, t, .] views, the same sums as the
            # einsums below, at a third of their dispatch cost for a decode step's few rows.
            q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
            q = torch.cat((q_lat, q_pe), dim=-1).to(torch.float32)
            o = paged_attention(q, kv, common.block_table, metadata.query_start_loc,
                                metadata.seq_lens, metadata.decode_rows, scale, checked=False)
            o_lat = o[:, :, :kv_lora_rank].to(q_nope.dtype)
            return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, dn_dv - dn)
        tokens = metadata.decode_tokens
        q_lat = torch.einsum("thd,hdl->thl", q_nope[tokens], w_uk)
        q = torch.zeros(q_nope.shape[0], num_heads, latent_size, dtype=torch.float32)
        q[tokens] = torch.cat((q_lat, q_pe[tokens]), dim=-1).float()
        o = paged_attention(q, kv, common.block_table, metadata.query_start_loc,
                            metadata.seq_lens, metadata.decode_rows, scale, checked=False)
        o_lat = o[tokens, :, :kv_lora_rank].to(q_nope.dtype)
        out[tokens] = torch.einsum("thl,hvl->thv", o_lat, w_uv)

        for g in metadata.sdpa.groups:
            num_rows, q_len = g.query_index.shape
            if q_len == 1:
                continue
            ctx = dequantize_kv(kv_cache, 0, g.kv_slots.reshape(-1), q_nope.dtype)
            o = mla_attention_expanded(q_nope[g.query_index], q_pe[g.query_index],
                                       ctx.view(num_rows, -1, latent_size), w_kv_b,
                                       g.attn_mask, scale)
            out[g.out_index] = o.reshape(num_rows * q_len, num_heads, -1)[g.valid]
        return out
