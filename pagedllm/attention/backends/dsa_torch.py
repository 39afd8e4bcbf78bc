"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer's top-k selection and
sparse MLA over the selected latents; torch reference ops and backend.

DSA (DeepSeek-V3.2-Exp report; transformers' `DeepseekV32Indexer`, vLLM's `Indexer` +
`FlashMLASparseBackend`) puts a small scorer in front of MLA (mla_torch.py). Per layer, for a
query token t at position p and every context token s <= p of its request:

    index score  I[t, s] = sum_h w[t, h] * relu(scale_I * q_I[t, h] . k_I[s])
                 (q_I [Hi, D] from q_resid, k_I [D] cached per token in the indexer cache,
                  w [Hi] = weights_proj(x) * Hi^-0.5, scale_I = D^-0.5; RoPE on the first
                  qk_rope_head_dim of q_I and k_I)
    selected     S(t) = the index_topk context positions of highest I[t, .], causal
                 (all of them while p + 1 <= index_topk)
    attention    MLA with the softmax over S(t) only.

Selections are positions in the request's context (as `torch_sdpa`'s row groups gather it), -1
for none, so the same rows index the latent cache through the group's `kv_slots`. Sparse MLA
reads only the selected entries:

    decode rows (query_len == 1), absorbed: gather the K selected latents [K, L + dr] and attend
        with q = [W_UK^T q_nope | q_pe] over them as one shared head (cost per token: K latents).
    prefill rows (query_len > 1), `sparse_prefill`, a tile of queries at a time: the tile's
        indexer scores over the context up to its last allowed position (causal), top-k, then
        the absorbed form over each query's gathered latents; a tile whose queries may each
        see at most index_topk tokens selects them all and runs dense masked MLA.

The indexer's own scores are dense: [Qt, S] per tile of a row group and layer (Hi heads
summed), as HF's and vLLM's indexers score every context token; only the attention is sparse.

The indexer's scores are float32 (as HF's). Hadamard rotation: DeepSeek's reference inference
code (`rotate_activation`) and vLLM rotate q_I and k_I by the orthonormal Walsh-Hadamard matrix
H_D / sqrt(D) before quantizing them to fp8; transformers' `DeepseekV32Indexer` (the oracle)
skips both the rotation and the quantization. The rotation leaves q . k unchanged in exact
arithmetic and spreads an outlier channel over all D values, so the per-token quantization
step of a C8 cache is smaller. Here (`rotate_for_cache`): a C8 indexer cache stores rotated
keys and the queries are rotated to match (the reference's quantized path); a float cache is
scored unrotated, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedllm.attention.backends.mla_torch import mla_attention_absorbed
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.indexer_cache_layout import is_c8, read_indexer_keys, write_indexer_keys
from pagedllm.kv_cache_layout import dequantize_kv, write_cache_rows

# Most elements of a query tile's indexer scores `sparse_prefill` holds at once (64 MiB in
# float32).
_TILE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class IndexerInputs:
    """One layer's indexer tensors for the step's tokens.

    q: [num_tokens, Hi, D] indexer queries (RoPE applied); k: [num_tokens, D] indexer keys (RoPE
    applied; written to `cache`); weights: [num_tokens, Hi] float32 head weights (Hi^-0.5
    included); cache: the layer's indexer cache (indexer_cache_layout.py); scale: D^-0.5;
    topk: index_topk.
    """

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    cache: torch.Tensor
    scale: float
    topk: int


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x H_D / sqrt(D) over the last axis: the orthonormal Walsh-Hadamard rotation (Sylvester's
    order, H_2n = [[H_n, H_n], [H_n, -H_n]], as DeepSeek's `rotate_activation` applies it with
    scale D^-0.5), by the fast transform's log2(D) butterfly passes (O(D log D) per row).

    Args:
        x: [..., D] floating; D a power of two.

    Returns:
        [..., D] float32 (H is symmetric and orthonormal: applying it twice gives x back).

    Raises:
        ValueError: D not a power of two (naming index_head_dim, the only D it is used for).
    """
    dim = x.shape[-1]
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"the Hadamard rotation of the DSA indexer needs index_head_dim a "
                         f"power of two, got {dim}")
    lead = x.shape[:-1]
    y = x.to(torch.float32).reshape(-1, dim)
    h = 1
    while h < dim:
        pairs = y.view(-1, dim // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, dim)
        h *= 2
    return (y * dim ** -0.5).view(*lead, dim)


def rotate_for_cache(indexer: IndexerInputs) -> IndexerInputs:
    """The indexer inputs as the layer's cache scores them: with a C8 cache q and k Hadamard-
    rotated (`hadamard_transform`; module docstring), else unchanged."""
    if not is_c8(indexer.cache.dtype):
        return indexer
    return replace(indexer, q=hadamard_transform(indexer.q), k=hadamard_transform(indexer.k))


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """The lightning indexer's scores (module docstring), as HF's `DeepseekV32Indexer`.

    Args:
        q: [G, Q, Hi, D]; weights: [G, Q, Hi] (Hi^-0.5 included); keys: [G, S, D].
        scale: D^-0.5.

    Returns:
        [G, Q, S] float32.
    """
    scores = torch.einsum("gqhd,gsd->gqhs", q.float(), keys.float()).mul_(scale).relu_()
    return torch.einsum("gqh,gqhs->gqs", weights.float(), scores)


def select_topk(scores: torch.Tensor, mask: torch.Tensor, topk: int) -> torch.Tensor:
    """The top-`topk` context positions of each query among those `mask` allows.

    Args:
        scores: [G, Q, S] float32; mask: [G, Q, S] bool (True = may attend; causal).
        topk: index_topk.

    Returns:
        [G, Q, min(topk, S)] int64 positions, -1 where fewer than topk are allowed.
    """
    masked = scores.masked_fill(~mask, float("-inf"))
    values, positions = masked.topk(min(topk, scores.shape[-1]), dim=-1)
    return torch.where(values == float("-inf"), -1, positions)


def sparse_mla_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, selected: torch.Tensor,
                        valid: torch.Tensor, w_kv_b: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse MLA in the absorbed form: each query over its own gathered latents.

    Args:
        q_nope: [T, H, dn]; q_pe: [T, H, dr] (RoPE applied).
        selected: [T, K, L + dr] each query's selected latents; valid: [T, K] bool (at least
            one True per row).
        w_kv_b: [H, dn + dv, L]; scale: softmax scale.

    Returns:
        [T, H, dv].
    """
    dn = q_nope.shape[-1]
    kv_lora_rank = w_kv_b.shape[-1]
    w_uk, w_uv = w_kv_b.split([dn, w_kv_b.shape[1] - dn], dim=1)
    q = torch.cat((torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe), dim=-1)
    # (batched matmuls over the T queries: SDPA's CPU math path on [T, 1, H, K] costs more)
    scores = torch.bmm(q, selected.transpose(1, 2)).mul_(scale)             # [T, H, K]
    probs = scores.float().masked_fill_(~valid[:, None, :], float("-inf")).softmax(-1)
    o_lat = torch.bmm(probs.to(selected.dtype), selected[..., :kv_lora_rank])
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)


def sparse_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                   index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor,
                   mask: torch.Tensor, w_kv_b: torch.Tensor, scale: float, index_scale: float,
                   topk: int, max_tile_elements: int = _TILE_ELEMENTS) -> torch.Tensor:
    """DSA of prefill chunks, a tile of queries at a time: the tile's indexer scores over the
    context up to its last allowed position (one batched matmul), top-k per query, then sparse
    MLA in the absorbed form over each query's gathered latents (`sparse_mla_absorbed`). A tile
    whose every query may attend to at most `topk` tokens selects them all: it runs dense
    masked MLA (`mla_attention_absorbed`) without scoring.

    Args:
        q_nope: [G, Q, H, dn]; q_pe: [G, Q, H, dr] (RoPE applied).
        latent: [G, S, L + dr] the context's latents.
        index_q: [G, Q, Hi, D]; index_weights: [G, Q, Hi]; keys: [G, S, D] the context's
            indexer keys (as `indexer_scores`).
        mask: [G, Q, S] bool, True = may attend (causal).
        w_kv_b: [H, dn + dv, L]; scale: softmax scale; index_scale: D^-0.5; topk: index_topk.
        max_tile_elements: most elements of a tile's [G, Qt, Hi, S] indexer scores (also
            bounds its [G, Qt, K, L + dr] gathered latents).

    Returns:
        [G, Q, H, dv] in q_nope's dtype (queries whose mask row is all False: undefined).
    """
    num_rows, q_len, num_heads, _ = q_nope.shape
    seq_len = latent.shape[1]
    per_query = num_rows * max(index_q.shape[2] * seq_len, min(topk, seq_len) * latent.shape[-1])
    step = max(1, max_tile_elements // max(per_query, 1))
    out = q_nope.new_empty(num_rows, q_len, num_heads, w_kv_b.shape[1] - q_nope.shape[-1])
    rows = torch.arange(0, num_rows * seq_len, seq_len, device=latent.device)[:, None, None]
    for start in range(0, q_len, step):
        sl = slice(start, start + step)
        tile_mask = mask[:, sl]
        allowed = tile_mask.any(dim=(0, 1)).nonzero()
        # causal: the tile's queries see nothing past its last allowed position
        width = int(allowed[-1]) + 1 if len(allowed) else 1
        tile_mask = tile_mask[:, :, :width]
        if int(tile_mask.sum(-1).max()) <= topk:
            out[:, sl] = mla_attention_absorbed(q_nope[:, sl], q_pe[:, sl], latent[:, :width],
                                                w_kv_b, tile_mask[:, None], scale)
            continue
        scores = indexer_scores(index_q[:, sl], index_weights[:, sl], keys[:, :width],
                                index_scale)
        positions = select_topk(scores, tile_mask, topk)                  # [G, Qt, K]
        tile = positions.shape[1]
        flat = (rows + positions.clamp(min=0)).flatten()                # rows of latent [G S]
        selected = latent.flatten(0, 1).index_select(0, flat).view(*positions.shape, -1)
        o = sparse_mla_absorbed(q_nope[:, sl].flatten(0, 1), q_pe[:, sl].flatten(0, 1),
                                selected.flatten(0, 1), (positions >= 0).flatten(0, 1),
                                w_kv_b, scale)
        out[:, sl] = o.view(num_rows, tile, num_heads, -1)
    return out


class DSATorchBackend:
    """Reference DSA over the paged latent and indexer caches, on any device torch supports
    (module docstring). Row groups as `torch_sdpa` builds them."""

    name = "dsa_torch"

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        return TorchSDPABackend.build_metadata(common)

    @staticmethod
    def forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchSDPAMetadata, w_kv_b: torch.Tensor,
                scale: float, indexer: IndexerInputs) -> torch.Tensor:
        """Write the new tokens' latents and indexer keys, select each query's top-k context
        tokens and attend over them.

        Args:
            q_nope, q_pe, latent, kv_cache, metadata, w_kv_b, scale: as `MLATorchBackend.forward`.
            indexer: the layer's indexer tensors and cache.

        Returns:
            [num_tokens, H, dv] (padded tokens are zero).
        """
        common = metadata.common
        indexer = write_caches(latent, kv_cache, indexer, common)
        num_heads, dn_dv, _ = w_kv_b.shape
        out = q_nope.new_zeros(q_nope.shape[0], num_heads, dn_dv - q_nope.shape[-1])
        for g in metadata.groups:
            forward_group(g, q_nope, q_pe, kv_cache, w_kv_b, scale, indexer, out)
        return out


def write_caches(latent: torch.Tensor, kv_cache: torch.Tensor, indexer: IndexerInputs,
                 common: CommonAttentionMetadata) -> IndexerInputs:
    """Write the step's latents [n, L + dr] and indexer keys to their slots; returns the
    indexer inputs as the cache scores them (`rotate_for_cache`)."""
    n = common.num_actual_tokens
    slots = common.slot_mapping[:n]
    indexer = rotate_for_cache(indexer)
    write_cache_rows(kv_cache, 0, latent[:n, None], slots)
    write_indexer_keys(indexer.cache, indexer.k[:n], slots)
    return indexer


def forward_group(g, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  w_kv_b: torch.Tensor, scale: float, indexer: IndexerInputs,
                  out: torch.Tensor) -> None:
    """DSA of one `torch_sdpa` row group `g` (after `write_caches`): select each query's top-k
    and attend (decode rows: absorbed over the gathered latents; prefill chunks:
    `sparse_prefill`), into `out` [num_tokens, H, dv] at the group's tokens."""
    num_heads = w_kv_b.shape[0]
    latent_size = kv_cache.shape[-1]
    num_rows, q_len = g.query_index.shape
    keys = read_indexer_keys(indexer.cache, g.kv_slots.reshape(-1))
    keys = keys.view(num_rows, -1, keys.shape[-1])
    if q_len > 1:
        ctx = dequantize_kv(kv_cache, 0, g.kv_slots.reshape(-1), q_nope.dtype)
        o = sparse_prefill(q_nope[g.query_index], q_pe[g.query_index],
                           ctx.view(num_rows, -1, latent_size), indexer.q[g.query_index],
                           indexer.weights[g.query_index], keys, g.attn_mask[:, 0], w_kv_b,
                           scale, indexer.scale, indexer.topk)
        out[g.out_index] = o.reshape(num_rows * q_len, num_heads, -1)[g.valid]
        return
    tokens = g.query_index[:, 0]
    scores = indexer_scores(indexer.q[g.query_index], indexer.weights[g.query_index], keys,
                            indexer.scale)
    pos = select_topk(scores, g.attn_mask[:, 0], indexer.topk)[:, 0]     # [G, K]
    chosen = g.kv_slots.gather(1, pos.clamp(min=0))                      # [G, K]
    selected = dequantize_kv(kv_cache, 0, chosen.reshape(-1), q_nope.dtype)
    out[tokens] = sparse_mla_absorbed(q_nope[tokens], q_pe[tokens],
                                      selected.view(num_rows, -1, latent_size), pos >= 0,
                                      w_kv_b, scale)
