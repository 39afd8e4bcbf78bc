"""OLMoE (`OlmoeForCausalLM`): a sparse MoE block in every layer (softmax, top-k, renormalised
when `norm_topk_prob`), and attention whose q/k RMSNorms span the whole projection.

    q = RMSNorm_{num_heads * head_size}(x Wq^T)      k = RMSNorm_{num_kv_heads * head_size}(x Wk^T)
    (then clamped to +-clip_qkv with v, when the config sets it) -> RoPE -> attention

Unlike Qwen3's per-head norms, one token's mean square is taken over all heads (HF's
OlmoeAttention). Under tensor parallelism each rank holds some heads, so `ProjectionRMSNorm`
all-reduces the per-token sum of squares before normalising its own columns.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear, default_weight_loader
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a projection whose columns are split across tensor-parallel ranks.

    x / sqrt(mean(x^2) + eps) * weight in float32 (cast back before the weight, as HF's Llama
    RMSNorm), where the mean runs over the full projection: the rank's sum of squares is
    all-reduced. A rank holding a replica (KV heads replicated over ranks) contributes its
    replica's sum as often as it is replicated, so dividing the reduced sum by
    tp_size * local_size gives the full mean in both cases.

    Args:
        local_size: columns held by this rank.
        eps: added to the mean square.
        shard_index: which `local_size` slice of the checkpoint's weight this rank holds.

    forward(x [n, local_size]) -> [n, local_size] in x's dtype.
    """

    def __init__(self, local_size: int, eps: float, shard_index: int) -> None:
        super().__init__()
        self.eps = eps
        self.tp_size = get_tensor_model_parallel_world_size()
        self.local_size = local_size
        self.shard_start = shard_index * local_size
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded.narrow(0, self.shard_start, self.local_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_sq = xf.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            sum_sq = tensor_model_parallel_all_reduce(sum_sq)
        mean_sq = sum_sq / (self.tp_size * self.local_size)
        return self.weight * (xf * torch.rsqrt(mean_sq + self.eps)).to(x.dtype)


class OlmoeAttention(nn.Module):
    """forward(positions [n] int64, hidden [n, hidden_size]) -> [n, hidden_size]."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // total_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, total_heads, total_kv_heads,
                                          bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hidden, bias)
        rank = get_tensor_model_parallel_rank()
        self.q_norm = ProjectionRMSNorm(self.q_size, config.rms_norm_eps, rank)
        self.k_norm = ProjectionRMSNorm(self.kv_size, config.rms_norm_eps,
                                        rank // self.qkv_proj.num_kv_head_replicas)
        self.clip_qkv = getattr(config, "clip_qkv", None)
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings,
                                          rope_parameters_from_hf(config.to_dict()))
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads,
                              self.head_size ** -0.5, f"model.layers.{layer_idx}.self_attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = self.rotary_emb(positions, q.reshape(n, self.num_heads, self.head_size),
                               k.reshape(n, self.num_kv_heads, self.head_size))
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE causal LM (see `MoeForCausalLM` for the API)."""

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        return OlmoeAttention(config, layer_idx)

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.intermediate_size, bool(config.norm_topk_prob),
                              config.hidden_act)
