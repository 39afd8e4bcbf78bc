"""Granite 4 hybrid (`GraniteMoeHybridForCausalLM`): Mamba-2 layers with attention layers, each
followed by a mixture of experts plus a shared MLP, and Granite's scalar multipliers.

    embed * embedding_multiplier
      -> [ RMSNorm -> (Mamba-2 mixer | attention) -> res + out * residual_multiplier
           -> RMSNorm -> (MoE + shared MLP | shared MLP) -> res + out * residual_multiplier ] x L
      -> RMSNorm -> LM head / logits_scaling

The Mamba-2 mixer is `models/mamba2.py`'s (the config's `mamba_*` fields); attention scales q.k
by `attention_multiplier` and uses RoPE only when `position_embedding_type` is "rope"; the
router takes the top-k logits and softmaxes them (= softmax, top-k, renormalise). HF
transformers' torch path is the oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.models.mamba_hybrid_gguf import (granitehybrid_checkpoint_weights,
                                         granitehybrid_hf_config)
from pagedllm.models.hybrid import HybridForCausalLM
from pagedllm.models.mamba2 import Mamba2Mixer, mamba_mixer_config
from pagedllm.models.moe import ReplicatedLinear

LAYER_TYPES = ("linear_attention", "attention", "full_attention")
# Checkpoint name pieces -> ours (the routed experts live under `mlp`, as in models/moe.py).
_CHECKPOINT_RENAMES = ((".block_sparse_moe.router.layer.", ".mlp.gate."),
                       (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
                       (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"))


class GraniteAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = hidden // heads
        bias = bool(config.attention_bias)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_size, bias)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * self.head_size, bias)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * self.head_size, bias)
        self.o_proj = ColumnParallelLinear(heads * self.head_size, hidden, bias)
        self.rotary_emb = (RotaryEmbedding(self.head_size, config.max_position_embeddings,
                                           rope_parameters_from_hf(config.to_dict()))
                           if config.position_embedding_type == "rope" else None)
        self.attn = Attention(heads, self.head_size, kv_heads, config.attention_multiplier,
                              f"model.layers.{layer_idx}.self_attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q = self.q_proj(hidden).view(n, self.num_heads, self.head_size)
        k = self.k_proj(hidden).view(n, self.num_kv_heads, self.head_size)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), self.v_proj(hidden)))


class GraniteSharedMLP(nn.Module):
    """input_linear -> [gate | up] -> silu(gate) * up -> output_linear. (`input_linear` loads
    whole, or as its halves `gate_proj` / `up_proj`: a GGUF file's split tensors.)"""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_linear = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.output_linear = ColumnParallelLinear(intermediate, hidden)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act_fn(self.input_linear(x)))


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.is_attention_layer = layer_type != "linear_attention"
        if self.is_attention_layer:
            self.self_attn = GraniteAttention(config, layer_idx)
        else:
            self.mamba = Mamba2Mixer(mamba_mixer_config(config), layer_idx)
            self.mamba.state.layer_name = f"model.layers.{layer_idx}.mamba"
        self.mlp = None   # the routed experts: mlp.gate (router), mlp.experts
        if config.num_local_experts > 0:
            self.mlp = nn.Module()
            self.mlp.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts)
            self.mlp.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok,
                                    config.hidden_size, config.intermediate_size, True,
                                    hidden_act=config.hidden_act)
        self.shared_mlp = GraniteSharedMLP(config.hidden_size, config.shared_intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        h = self.self_attn(positions, h) if self.is_attention_layer else self.mamba(h)
        hidden = hidden + h * self.residual_multiplier
        h = self.post_attention_layernorm(hidden)
        out = self.shared_mlp(h)
        if self.mlp is not None:
            out = self.mlp.experts(h, self.mlp.gate(h)) + out
        return hidden + out * self.residual_multiplier


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """Granite 4 hybrid's stack (`model.{embed_tokens,layers,norm}`) on `HybridForCausalLM`;
    its API. The experts' stacked `input_linear` [E, 2I, H] and `output_linear` [E, H, I] load
    as FusedMoE's fused gate_up / down tensors. llama.cpp's `granitehybrid` files load through
    `mamba_hybrid_gguf.granitehybrid_hf_config` / `granitehybrid_checkpoint_weights`.

    Raises:
        ValueError: at construction, for a layer type other than "linear_attention" /
            "attention" (naming it), or with tensor / pipeline parallelism.
    """

    stacked_params_mapping = (("shared_mlp.input_linear", "shared_mlp.gate_proj", 0),
                              ("shared_mlp.input_linear", "shared_mlp.up_proj", 1))
    gguf_architecture: str | None = "granitehybrid"

    @classmethod
    def gguf_hf_config(cls, metadata: dict, tensors: dict):
        """The HF config of a `granitehybrid` GGUF file
        (`mamba_hybrid_gguf.granitehybrid_hf_config`)."""
        return granitehybrid_hf_config(metadata, tensors)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """Checkpoint tensors of a `granitehybrid` GGUF file
        (`mamba_hybrid_gguf.granitehybrid_checkpoint_weights`)."""
        return granitehybrid_checkpoint_weights(config, weights, cls.__name__)

    def __init__(self, config) -> None:
        super().__init__(config, config.layers_block_type, LAYER_TYPES,
                         lambda i, t: GraniteMoeHybridDecoderLayer(config, i, t),
                         RMSNorm(config.hidden_size, config.rms_norm_eps),
                         embedding_multiplier=config.embedding_multiplier)
        self.logits_scaling = config.logits_scaling

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) / self.logits_scaling

    def checkpoint_tensors(self, name: str, tensor):
        for theirs, ours in _CHECKPOINT_RENAMES:
            name = name.replace(theirs, ours)
        if name.endswith(".shared_mlp.input_linear.weight"):   # [gate | up] -> the two halves
            half = tensor.shape[0] // 2
            stem = name[:-len("input_linear.weight")]
            return ((f"{stem}gate_proj.weight", tensor.narrow(0, 0, half)),
                    (f"{stem}up_proj.weight", tensor.narrow(0, half, half)))
        return ((name, tensor),)
