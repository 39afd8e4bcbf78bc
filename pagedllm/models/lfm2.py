"""LFM2 (`Lfm2ForCausalLM`): gated short-convolution layers with a few attention layers.

    embed -> [ RMSNorm -> (ShortConv | attention) -> +res -> RMSNorm -> SwiGLU -> +res ] x L
          -> RMSNorm -> LM head

    ShortConv:  in_proj -> [ B | C | x ];  y = out_proj(C * conv(B * x))
                conv: causal depthwise, kernel L_cache, no activation; its window of the last
                L_cache - 1 inputs is the layer's state (layers/state_cache.py)
    attention:  q/k RMSNorm per head, RoPE, GQA, over the paged KV cache

`config.layer_types` says which layer is which ("conv" / "full_attention"); the conv layers'
states live in the state cache group, the attention layers' KV in the paged groups. HF
transformers' Lfm2 torch path is the oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                    QKVParallelLinear, default_weight_loader)
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.layers.state_cache import StateCache
from pagedllm.layers.state_kernels import causal_conv1d_varlen
from pagedllm.models.hybrid import HybridForCausalLM
from pagedllm.models.hybrid_gguf import lfm2_checkpoint_weights

LAYER_TYPES = ("conv", "full_attention")


def lfm2_intermediate_size(config) -> int:
    """The SwiGLU width HF's Lfm2MLP derives (`block_auto_adjust_ff_dim`: 2/3, times
    `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`)."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * (-(-size // config.block_multiple_of))
    return size


class Lfm2ShortConv(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.hidden_size = hidden
        k = config.conv_L_cache
        self.in_proj = ColumnParallelLinear(hidden, 3 * hidden, config.conv_bias)
        self.out_proj = ColumnParallelLinear(hidden, hidden, config.conv_bias)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(hidden, 1, k), requires_grad=False)
        self.conv.weight.weight_loader = default_weight_loader
        self.conv.bias = None
        if config.conv_bias:
            self.conv.bias = nn.Parameter(torch.empty(hidden), requires_grad=False)
            self.conv.bias.weight_loader = default_weight_loader
        self.state = StateCache(((hidden, k - 1),), (torch.get_default_dtype(),),
                                f"model.layers.{layer_idx}.conv")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = self.state.metadata()
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        conv = causal_conv1d_varlen(b * x, self.conv.weight[:, 0], self.conv.bias,
                                    self.state.states[0], meta)
        return self.out_proj(c * conv)


class Lfm2Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, kv_heads, False)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.out_proj = ColumnParallelLinear(heads * self.head_size, hidden, False)
        self.q_layernorm = RMSNorm(self.head_size, config.norm_eps)
        self.k_layernorm = RMSNorm(self.head_size, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings,
                                          rope_parameters_from_hf(config.to_dict()))
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads,
                              self.head_size ** -0.5, f"model.layers.{layer_idx}.self_attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_layernorm(q.reshape(n, self.num_heads, self.head_size))
        k = self.k_layernorm(k.reshape(n, self.num_kv_heads, self.head_size))
        q, k = self.rotary_emb(positions, q, k)
        return self.out_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.is_attention_layer = layer_type == "full_attention"
        if self.is_attention_layer:
            self.self_attn = Lfm2Attention(config, layer_idx)
        else:
            self.conv = Lfm2ShortConv(config, layer_idx)
        size = lfm2_intermediate_size(config)
        self.feed_forward = nn.Module()
        self.feed_forward.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                                    [size, size])
        self.feed_forward.w2 = ColumnParallelLinear(size, config.hidden_size)
        self.act_fn = SiluAndMul()
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.operator_norm(hidden)
        h = self.self_attn(positions, h) if self.is_attention_layer else self.conv(h)
        hidden = hidden + h
        ff = self.feed_forward
        return hidden + ff.w2(self.act_fn(ff.gate_up_proj(self.ffn_norm(hidden))))


class Lfm2ForCausalLM(HybridForCausalLM):
    """LFM2's stack (`model.{embed_tokens,layers,embedding_norm}`, tied embeddings by default)
    on `HybridForCausalLM`; its API.

    Raises:
        ValueError: at construction, for a layer type other than "conv" / "full_attention"
            (naming it), or with tensor / pipeline parallelism.
    """

    stacked_params_mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                              ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "w1", 0),
                              ("gate_up_proj", "w3", 1))
    gguf_architecture = "lfm2"

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """HF-named tensors of an `lfm2` GGUF file (`hybrid_gguf.lfm2_checkpoint_weights`)."""
        return lfm2_checkpoint_weights(weights, cls.__name__)

    def __init__(self, config) -> None:
        super().__init__(config, config.layer_types, LAYER_TYPES,
                         lambda i, t: Lfm2DecoderLayer(config, i, t),
                         RMSNorm(config.hidden_size, config.norm_eps), norm="embedding_norm",
                         tie_word_embeddings=True)
