"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3 with DeepSeek Sparse Attention (DSA),
as transformers 5 defines it.

Every layer's MLA (models/deepseek_v2.py) gets a lightning indexer that picks, per query, the
`index_topk` context tokens the attention may see (attention/backends/dsa_torch.py):

    q_resid = RMSNorm(q_a_proj(x))                              (MLA's, shared)
    q_I     = wq_b(q_resid) -> [Hi, D]; k_I = LayerNorm(wk(x)) [D]
    RoPE    on the first qk_rope_head_dim of q_I and k_I, GPT-NeoX halves (MLA's own is
            interleaved), same frequencies as MLA's
    w       = weights_proj(x) * Hi^-0.5  (float32, as HF keeps weights_proj)
    cache   <- k_I (the indexer cache, a tensor beside the latent: layers/sparse_mla_attention.py)

(Hi = index_n_heads, D = index_head_dim.) The indexer is replicated on every tensor-parallel
rank (vLLM does the same), so every rank selects the same tokens for its heads. MoE, routing and
the MTP layers skipped at load are V3's; `mlp_layer_types` ("dense" / "sparse" per layer) picks
the MLP where given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.deepseek_rope import DeepseekRotaryEmbedding, deepseek_rope_parameters
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import default_weight_loader
from pagedllm.layers.sparse_mla_attention import SparseMLAAttention
from pagedllm.models.deepseek_v2 import DeepseekMLAAttention, DeepseekV3ForCausalLM
from pagedllm.models.moe import ReplicatedLinear

# HF's indexer k_norm is nn.LayerNorm(index_head_dim, eps=1e-6).
_INDEXER_NORM_EPS = 1e-6
_LAYER_TYPES = ("indexed_attention",)
_MLP_LAYER_TYPES = ("dense", "sparse")


def check_dsa_config(config) -> None:
    """Validate the DSA fields of a DeepSeek-V3.2 config.

    Raises:
        ValueError: naming the field: q_lora_rank None (the indexer reads q_resid), index_topk,
            index_n_heads or index_head_dim out of range (index_head_dim >= qk_rope_head_dim),
            a `layer_types` entry other than "indexed_attention", an `mlp_layer_types` entry
            other than "dense" / "sparse".
    """
    if config.q_lora_rank is None:
        raise ValueError("q_lora_rank is None: DeepSeek-V3.2's indexer projects the query "
                         "from q_a_layernorm(q_a_proj(x)), so it needs a q_lora_rank")
    for field in ("index_topk", "index_n_heads", "index_head_dim"):
        value = getattr(config, field, None)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be a positive int, got {value!r}")
    if config.index_head_dim < config.qk_rope_head_dim:
        raise ValueError(f"index_head_dim {config.index_head_dim} is smaller than "
                         f"qk_rope_head_dim {config.qk_rope_head_dim} (RoPE covers the first "
                         "qk_rope_head_dim values of each indexer head)")
    for field, allowed in (("layer_types", _LAYER_TYPES), ("mlp_layer_types", _MLP_LAYER_TYPES)):
        values = getattr(config, field, None) or ()
        unknown = sorted({v for v in values if v not in allowed})
        if unknown:
            raise ValueError(f"unsupported {field} {unknown} for DeepseekV32ForCausalLM; "
                             f"supported: {list(allowed)}")
        if values and len(values) != config.num_hidden_layers:
            raise ValueError(f"{field} has {len(values)} entries for "
                             f"{config.num_hidden_layers} layers")


class Float32Linear(nn.Module):
    """y = x W^T in float32 with a float32 weight [out, in] (HF keeps `weights_proj` so)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.float32),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekV32Indexer(nn.Module):
    """The lightning indexer's projections (HF names: wq_b, wk, k_norm, weights_proj):
    forward(positions [n], hidden [n, hidden_size], q_resid [n, q_lora_rank]) ->
    (q_I [n, Hi, D], k_I [n, D], weights [n, Hi] float32), module docstring."""

    def __init__(self, config, rope_parameters: dict) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, _INDEXER_NORM_EPS)
        self.weights_proj = Float32Linear(config.hidden_size, self.n_heads)
        self.rotary_emb = DeepseekRotaryEmbedding(self.rope_dim, config.max_position_embeddings,
                                                  rope_parameters, interleaved=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        q = self.wq_b(q_resid).view(n, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden))
        q_rot, k_rot = self.rotary_emb(positions, q[..., :self.rope_dim],
                                       k[:, None, :self.rope_dim])
        q = torch.cat((q_rot, q[..., self.rope_dim:]), dim=-1)
        k = torch.cat((k_rot[:, 0], k[:, self.rope_dim:]), dim=-1)
        weights = self.weights_proj(hidden) * self.n_heads ** -0.5
        return q, k, weights


class DeepseekV32MLAAttention(DeepseekMLAAttention):
    """MLA with the DSA indexer (`.indexer`) and `SparseMLAAttention` at `.attn`:
    forward(positions [n], hidden [n, hidden_size]) -> [n, hidden_size]."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx, rope_interleave=True)
        dense = self.attn
        self.attn = SparseMLAAttention(dense.num_heads, dense.kv_lora_rank,
                                       dense.qk_rope_head_dim, dense.scale, dense.layer_name,
                                       config.index_head_dim, config.index_topk)
        self.indexer = DeepseekV32Indexer(config, deepseek_rope_parameters(config.to_dict()))

    def cache_layers(self) -> list[nn.Module]:
        """The layer's two caches: the latent's (`attn`) and the indexer's."""
        return [self.attn, self.attn.indexer_cache]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, latent, q_resid = self.project(positions, hidden)
        index_q, index_k, weights = self.indexer(positions, hidden, q_resid)
        return self.o_proj(self.attn(q_nope, q_pe, latent, self.w_kv_b, index_q, index_k,
                                     weights))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 causal LM (see `DeepseekV3ForCausalLM`): every layer's attention is DSA.
    `attention_layers()` lists each layer's latent cache layer and then its indexer cache layer.

    Raises (construction, i.e. at load):
        ValueError: naming the field (`check_dsa_config`), and V3's (routing, rope, bias).
    """

    def __init__(self, config) -> None:
        check_dsa_config(config)
        super().__init__(config)

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        return DeepseekV32MLAAttention(config, layer_idx)

    @classmethod
    def is_dense_layer(cls, config, layer_idx: int) -> bool:
        """`mlp_layer_types[layer_idx]` == "dense" where given (MTP layers, past the list, are
        MoE), else V3's rule."""
        types = getattr(config, "mlp_layer_types", None)
        if not types:
            return super().is_dense_layer(config, layer_idx)
        return layer_idx < len(types) and types[layer_idx] == "dense"

    def attention_layers(self) -> list[nn.Module]:
        layers = list(self.model.layers)[self.model.start_layer:self.model.end_layer]
        return [cache for layer in layers for cache in layer.self_attn.cache_layers()]
