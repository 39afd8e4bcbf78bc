"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet layers with gated attention every few
layers, and a mixture of experts with a shared expert.

    embed -> [ RMSNorm -> (GatedDeltaNet | gated attention) -> +res
               -> RMSNorm -> (sparse MoE + shared expert | dense MLP) -> +res ] x L
          -> RMSNorm -> LM head                 (RMSNorms: x * (1 + w), zero-centred weights)

    GatedDeltaNet:  in_proj_qkvz -> q, k, v, z (grouped per key head);  in_proj_ba -> b, a
                    [q|k|v] -> causal depthwise conv1d (window state) -> silu
                    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
                    o = gated delta rule(q, k, v, g, beta) (recurrent state [H_v, d_k, d_v])
                    out_proj(RMSNorm(o) * silu(z))              (layers/gated_delta_ops.py)
    gated attention: q_proj -> [q | gate] per head; q/k RMSNorm, partial RoPE, GQA over the
                     paged KV cache; o_proj(attn * sigmoid(gate))

`config.layer_types` ("linear_attention" / "full_attention") says which layer is which. HF
transformers' Qwen3-Next torch path is the oracle.

Qwen3.5's text model (`Qwen3_5ForCausalLM`) is the same stack with the Gated DeltaNet's inputs
projected separately (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; q, k, v contiguous rather
than grouped per key head) and dense MLPs only. Its multimodal RoPE (interleaved sections) is
plain RoPE for text, where the three position components are equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import ColumnParallelLinear, default_weight_loader
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.layers.state_cache import StateCache
from pagedllm.layers.state_kernels import causal_conv1d_varlen, gated_delta_rule_varlen
from pagedllm.models.hybrid import HybridForCausalLM
from pagedllm.models.llama import LlamaMLP
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.models.qwen_moe import is_sparse_layer

LAYER_TYPES = ("linear_attention", "full_attention")


def _param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


class GatedDeltaNet(nn.Module):
    """hidden [n, hidden_size] -> [n, hidden_size] over the state cache."""

    def __init__(self, config, layer_idx: int, separate_projections: bool = False) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.separate_projections = separate_projections
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"Qwen3-Next: linear_num_value_heads {self.num_v_heads} is not a "
                             f"multiple of linear_num_key_heads {self.num_k_heads}")
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3-Next: hidden_act {config.hidden_act!r} is not implemented "
                             "(only 'silu')")
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        k = config.linear_conv_kernel_dim
        if separate_projections:   # Qwen3.5
            self.in_proj_qkv = ColumnParallelLinear(hidden, self.conv_dim)
            self.in_proj_z = ColumnParallelLinear(hidden, self.value_dim)
            self.in_proj_b = ColumnParallelLinear(hidden, self.num_v_heads)
            self.in_proj_a = ColumnParallelLinear(hidden, self.num_v_heads)
        else:
            self.in_proj_qkvz = ColumnParallelLinear(hidden,
                                                     2 * self.key_dim + 2 * self.value_dim)
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * self.num_v_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.conv_dim, 1, k)
        self.dt_bias = _param(self.num_v_heads)
        self.A_log = _param(self.num_v_heads)
        self.norm = nn.Module()
        self.norm.weight = _param(self.head_v_dim)
        self.norm_eps = config.rms_norm_eps
        self.out_proj = ColumnParallelLinear(self.value_dim, hidden)
        self.state = StateCache(((self.conv_dim, k - 1),
                                 (self.num_v_heads, self.head_k_dim, self.head_v_dim)),
                                (torch.get_default_dtype(), torch.float32),
                                f"model.layers.{layer_idx}.linear_attn")

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """HF's grouped layout: per key head [q | k | v of its value heads | z of them], and
        [b | a] of its value heads. Returns q, k [n, key_dim], v, z [n, H_v, d_v], b, a
        [n, H_v]."""
        n = qkvz.shape[0]
        per = self.num_v_heads // self.num_k_heads
        qkvz = qkvz.view(n, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, per * self.head_v_dim,
                                 per * self.head_v_dim], dim=-1)
        b, a = ba.view(n, self.num_k_heads, -1).split([per, per], dim=-1)
        return (q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1),
                z.reshape(n, self.num_v_heads, self.head_v_dim),
                b.reshape(n, self.num_v_heads), a.reshape(n, self.num_v_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = self.state.metadata()
        conv_state, recurrent_state = self.state.states
        n = hidden.shape[0]
        if self.separate_projections:
            qkv = self.in_proj_qkv(hidden)
            z = self.in_proj_z(hidden).view(n, self.num_v_heads, self.head_v_dim)
            b, a = self.in_proj_b(hidden), self.in_proj_a(hidden)
        else:
            q, k, v, z, b, a = self._split(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
            qkv = torch.cat([q, k, v], dim=-1)
        qkv = causal_conv1d_varlen(qkv, self.conv1d.weight[:, 0], None, conv_state, meta,
                                   activation="silu")
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # q, k keep their key heads: value head h reads key head h // (H_v / H_k).
        q = q.reshape(n, self.num_k_heads, self.head_k_dim)
        k = k.reshape(n, self.num_k_heads, self.head_k_dim)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = gated_delta_rule_varlen(q, k, v, g, beta, recurrent_state, meta)
        # RMSNorm per head before the gate (HF's Qwen3NextRMSNormGated).
        dtype = hidden.dtype
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        o = (self.norm.weight * o.to(dtype)) * F.silu(z.float())
        return self.out_proj(o.to(dtype).reshape(n, -1))


class GatedAttention(nn.Module):
    """Attention whose output is gated per channel by sigmoid of a second half of q_proj."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.q_proj = ColumnParallelLinear(hidden, 2 * heads * self.head_size, bias)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * self.head_size, bias)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * self.head_size, bias)
        self.o_proj = ColumnParallelLinear(heads * self.head_size, hidden, bias)
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings,
                                          rope_parameters_from_hf(config.to_dict()))
        self.attn = Attention(heads, self.head_size, kv_heads, self.head_size ** -0.5,
                              f"model.layers.{layer_idx}.self_attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q, gate = self.q_proj(hidden).view(n, self.num_heads, 2 * self.head_size).chunk(2, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(n, self.num_kv_heads, self.head_size))
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), self.v_proj(hidden))
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, layer_type: str,
                 separate_projections: bool = False) -> None:
        super().__init__()
        self.is_attention_layer = layer_type == "full_attention"
        if self.is_attention_layer:
            self.self_attn = GatedAttention(config, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_idx, separate_projections)
        if getattr(config, "num_experts", 0) and is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                      config.num_experts_per_tok, config.moe_intermediate_size,
                                      bool(config.norm_topk_prob), config.hidden_act,
                                      config.shared_expert_intermediate_size)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        h = self.self_attn(positions, h) if self.is_attention_layer else self.linear_attn(h)
        hidden = hidden + h
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Qwen3-Next's stack (`model.{embed_tokens,layers,norm}`) on `HybridForCausalLM`; its API.
    MTP tensors of released checkpoints are skipped (no MTP drafter here).

    Raises:
        ValueError: at construction, for a layer type other than "linear_attention" /
            "full_attention" (naming it), or with tensor / pipeline parallelism.
    """

    stacked_params_mapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    skipped_weight_prefixes = ("mtp.",)
    # Qwen3.5's Gated DeltaNet input projections (see the module docstring).
    separate_projections = False

    def __init__(self, config) -> None:
        super().__init__(
            config, config.layer_types, LAYER_TYPES,
            lambda i, t: Qwen3NextDecoderLayer(config, i, t, self.separate_projections),
            GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's text model (see the module docstring); the API of `Qwen3NextForCausalLM`."""

    separate_projections = True
