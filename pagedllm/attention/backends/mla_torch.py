"""Multi-head Latent Attention (MLA) over a paged latent cache: torch reference ops and backend.

MLA (DeepSeek-V2, arXiv:2405.04434, sec. 2.1) caches per token and layer one latent vector

    latent = [ c_kv (kv_lora_rank, RMS-normed) | k_pe (qk_rope_head_dim, RoPE applied) ]

shared by every head, instead of per-head K and V. The heads' keys and values are linear in c_kv:
k_nope_h = W_UK_h c_kv, v_h = W_UV_h c_kv (W_UK_h [dn, L], W_UV_h [dv, L]: the rows of the
checkpoint's `kv_b_proj` for head h), and k_h = [k_nope_h | k_pe]. Two exact rewritings of the
same attention, as vLLM's MLA backends use them:

    expanded (prefill rows, query_len > 1): gather the context's latents, expand them to per-head
        K [S, H, dn + dr] and V [S, H, dv] with kv_b_proj, plain attention with q = [q_nope | q_pe].
        Cost per token of context: H (dn + dv) L flops to expand, worth it when many queries share
        the context.
    absorbed (decode rows, query_len == 1): fold W_UK into the query, q_lat_h = W_UK_h^T q_nope_h
        [L], so q_nope_h . k_nope_h = q_lat_h . c_kv; attend over the latents themselves as one
        shared "KV head" of size L + dr (scores [q_lat | q_pe] . latent, values c_kv), then fold
        W_UV into the output, o_h = W_UV_h o_lat_h. The context is read once for all heads and
        never expanded.

Rows are split and gathered exactly as `torch_sdpa` does (its `build_metadata`: decode group and
prefill group, padded inside a group, one SDPA call per group and layer); an int8/fp8 latent
cache is quantized on write and dequantized after the gather (kv_cache_layout.py). Softmax scale:
the caller's (DeepSeek: (dn + dr)^-0.5 times YaRN's mscale^2).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import dequantize_kv, write_cache_rows


def mla_attention_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           w_kv_b: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """MLA in the expanded form (keys and values per head).

    Args:
        q_nope: [G, Q, H, dn]; q_pe: [G, Q, H, dr] (RoPE applied).
        latent: [G, S, L + dr] the context's latents ([c_kv | k_pe]).
        w_kv_b: [H, dn + dv, L] kv_b_proj's weight, per head.
        mask: [G, 1, Q, S] bool, True = attend (no row entirely False).
        scale: softmax scale.

    Returns:
        [G, Q, H, dv] in q_nope's dtype.
    """
    num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
    dn = q_nope.shape[-1]
    c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    kv = torch.einsum("gsl,hel->ghse", c_kv, w_kv_b)                        # [G, H, S, dn + dv]
    k_nope, v = kv.split([dn, dn_dv - dn], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, num_heads, -1, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)                    # [G, H, Q, dn + dr]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def mla_attention_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           w_kv_b: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """MLA in the absorbed form (attention over the latents, W_UK / W_UV folded in).

    Args and result as `mla_attention_expanded` (any Q; decode rows have Q = 1).
    """
    num_heads, dn_dv, kv_lora_rank = w_kv_b.shape
    num_rows, q_len, _, dn = q_nope.shape
    w_uk, w_uv = w_kv_b.split([dn, dn_dv - dn], dim=1)                   # [H, dn, L], [H, dv, L]
    q_lat = torch.einsum("gqhd,hdl->gqhl", q_nope, w_uk)
    q = torch.cat((q_lat, q_pe), dim=-1).reshape(num_rows, 1, q_len * num_heads, -1)
    # One shared "KV head": the Q * H query rows of a request attend over its latents.
    k = latent[:, None]                                                      # [G, 1, S, L + dr]
    v = latent[:, None, :, :kv_lora_rank]                                    # [G, 1, S, L]
    mask = mask.repeat_interleave(num_heads, dim=2) if q_len > 1 else mask
    o_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o_lat = o_lat.view(num_rows, q_len, num_heads, kv_lora_rank)
    return torch.einsum("gqhl,hvl->gqhv", o_lat, w_uv)


class MLATorchBackend:
    """Reference MLA over the paged latent cache on any device torch supports: prefill rows in
    the expanded form, decode rows in the absorbed form (module docstring)."""

    name = "mla_torch"

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        """The step's row groups (decode rows, then prefill rows), as `torch_sdpa` builds them."""
        return TorchSDPABackend.build_metadata(common)

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchSDPAMetadata, w_kv_b: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Write the new tokens' latents to the cache and attend.

        Args:
            q_nope: [num_tokens, H, dn]; q_pe: [num_tokens, H, dr] (RoPE applied).
            latent: [num_tokens, L + dr] the new tokens' latents ([c_kv | k_pe]).
            kv_cache: [1, num_blocks, block_size, 1, L + dr] the layer's latent cache, any
                cache dtype (int8/fp8 with their scales: kv_cache_layout.py).
            metadata: from `build_metadata`.
            w_kv_b: [H, dn + dv, L] kv_b_proj's weight per head (this rank's heads).
            scale: softmax scale.

        Returns:
            [num_tokens, H, dv] (padded tokens are zero).
        """
        common = metadata.common
        n = common.num_actual_tokens
        write_cache_rows(kv_cache, 0, latent[:n, None], common.slot_mapping[:n])
        num_heads, dn_dv, _ = w_kv_b.shape
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, dn_dv - q_nope.shape[-1])
        attend_row_groups(out, metadata.groups, q_nope, q_pe, kv_cache, w_kv_b, scale)
        return out


def attend_row_groups(out: torch.Tensor, groups, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      kv_cache: torch.Tensor, w_kv_b: torch.Tensor, scale: float) -> None:
    """MLA of the rows of `groups` (torch_sdpa's row groups) over their latents gathered and
    dequantized from the cache: decode groups (query_len 1) in the absorbed form, the others in
    the expanded form; written into `out` [num_tokens, H, dv] at the rows' tokens.

    Args:
        q_nope, q_pe, kv_cache, w_kv_b, scale: as `MLATorchBackend.forward` (the new tokens'
            latents already written).
    """
    num_heads = w_kv_b.shape[0]
    latent_size = kv_cache.shape[-1]
    for g in groups:
        num_rows, q_len = g.query_index.shape
        ctx = dequantize_kv(kv_cache, 0, g.kv_slots.reshape(-1), q_nope.dtype)
        ctx = ctx.view(num_rows, -1, latent_size)                            # [G, S, L + dr]
        attend = mla_attention_absorbed if q_len == 1 else mla_attention_expanded
        o = attend(q_nope[g.query_index], q_pe[g.query_index], ctx, w_kv_b, g.attn_mask, scale)
        out[g.out_index] = o.reshape(num_rows * q_len, num_heads, -1)[g.valid]


# How the kernel backends (mla_cpu_paged, mla_triton) run prefill chunks: "auto" per
# `prefers_absorbed`, or every chunk "absorbed" or "expanded" (tests, benchmarks).
PREFILL_FORMS = ("auto", "absorbed", "expanded")


def prefers_absorbed(query_lens: np.ndarray, seq_lens: np.ndarray, dims: tuple[int, int, int, int],
                     cost_factor: float) -> np.ndarray:
    """Per request, whether the absorbed form costs less than the expanded one; decodes
    (query_len 1) always do.

    Multiply-adds per head for a chunk of Q tokens over S positions (cached prefix C = S - Q):

        absorbed: Q (dn + dv) L  (W_UK into q, W_UV into o)  +  2 (L + dr) Q (C + Q / 2)
                  (scores and values over L + dr channels; a kernel skips the masked keys)
        expanded: S (dn + dv) L  (expand the context)  +  Q S (dn + dr + dv)  (SDPA, masked
                  keys included)

    The Q (dn + dv) L terms cancel; the absorbed form is chosen when cost_factor times its
    attention term is below the expanded form's rest. `cost_factor` is the absorbed kernel's
    cost per multiply-add relative to the expanded form's GEMMs (measured per backend).

    Args:
        query_lens, seq_lens: [num_reqs] new tokens and positions (cached prefix included).
        dims: (dn, dr, dv, L) = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank.
        cost_factor: as above.

    Returns:
        [num_reqs] bool.
    """
    dn, dr, dv, lat = dims
    q = query_lens.astype(np.float64)
    s = seq_lens.astype(np.float64)
    expanded = (s - q) * (dn + dv) * lat + q * s * (dn + dr + dv)
    absorbed = cost_factor * 2 * (lat + dr) * q * (s - q / 2)
    return (query_lens == 1) | (absorbed < expanded)


def absorbed_rows_mask(query_lens: np.ndarray, seq_lens: np.ndarray,
                       dims: tuple[int, int, int, int], prefill_form: str,
                       cost_factor: float) -> np.ndarray:
    """[num_reqs] bool: the requests to run in the absorbed form under `prefill_form` (one of
    PREFILL_FORMS; "auto": `prefers_absorbed` with `cost_factor`). Decodes always are."""
    if prefill_form == "auto":
        return prefers_absorbed(query_lens, seq_lens, dims, cost_factor)
    return (query_lens == 1) | (prefill_form == "absorbed")


def check_prefill_form(backend: str, prefill_form: str) -> None:
    """Raises ValueError naming `backend` for a prefill_form not in PREFILL_FORMS."""
    if prefill_form not in PREFILL_FORMS:
        raise ValueError(f"{backend}: prefill_form must be one of {PREFILL_FORMS}, "
                         f"got {prefill_form!r}")
