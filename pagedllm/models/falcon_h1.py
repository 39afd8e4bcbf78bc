"""Falcon-H1 (`FalconH1ForCausalLM`): every layer runs a Mamba-2 mixer and attention side by
side on the same normed input, then an MLP; muP multipliers scale each path.

    embed * embedding_multiplier
      -> [ h = RMSNorm(x)
           x += Mamba2Mixer(h) * ssm_out_multiplier + Attention(h * attention_in_multiplier)
                * attention_out_multiplier
           x += MLP(RMSNorm(x)) ]  x L                     (k scaled by key_multiplier)
      -> RMSNorm -> LM head * lm_head_multiplier

    MLP(x) = down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier

The mixer is `models/mamba2.py`'s (the config's `mamba_*` fields; intermediate size
`mamba_d_ssm`; the gated RMSNorm is optional, `mamba_rms_norm`, and may normalise before the
gate, `mamba_norm_before_gate`). Its input multiplier and per-section muP vector
(`ssm_multipliers` over z | x | B | C | dt of `in_proj`'s output) are folded into `in_proj`'s
rows at load (`in_proj(h * s) * m = (m * s * W) h + m * b`). Every layer holds both an attention
KV cache and a state slot. Reference: TII, "Falcon-H1" (2025); HF transformers' torch path is
the oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.models.hybrid import HybridForCausalLM
from pagedllm.models.mamba_hybrid_gguf import (falcon_h1_checkpoint_weights,
                                               falcon_h1_hf_config)
from pagedllm.models.mamba2 import Mamba2Mixer, mamba_mixer_config


def _ssm_intermediate_size(config) -> int:
    return (config.mamba_d_ssm if config.mamba_d_ssm is not None
            else int(config.mamba_expand * config.hidden_size))


def mup_vector(config) -> torch.Tensor:
    """[2 I + 2 G N + H] float32: `ssm_multipliers` over in_proj's z | x | B | C | dt rows (HF's
    compute_mup_vector)."""
    i = _ssm_intermediate_size(config)
    gn = config.mamba_n_groups * config.mamba_d_state
    sizes = (i, i, gn, gn, config.mamba_n_heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, config.ssm_multipliers)])


class FalconH1Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // heads
        bias = bool(config.attention_bias)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.key_multiplier = config.key_multiplier
        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_size, bias)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * self.head_size, bias)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * self.head_size, bias)
        self.o_proj = ColumnParallelLinear(heads * self.head_size, hidden, bias)
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings,
                                          rope_parameters_from_hf(config.to_dict()))
        self.attn = Attention(heads, self.head_size, kv_heads, self.head_size ** -0.5,
                              f"model.layers.{layer_idx}.self_attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q = self.q_proj(hidden).view(n, self.num_heads, self.head_size)
        k = (self.k_proj(hidden) * self.key_multiplier).view(n, self.num_kv_heads,
                                                             self.head_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), self.v_proj(hidden)))


class FalconH1MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        if config.hidden_act != "silu":
            raise ValueError(f"FalconH1ForCausalLM: hidden_act {config.hidden_act!r} is not "
                             "implemented (only 'silu')")
        self.gate_proj = ColumnParallelLinear(hidden, inter, bias)
        self.up_proj = ColumnParallelLinear(hidden, inter, bias)
        self.down_proj = ColumnParallelLinear(inter, hidden, bias)
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = nn.functional.silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(self.up_proj(x) * gate) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.mamba = Mamba2Mixer(mamba_mixer_config(
            config, ssm_intermediate_size=_ssm_intermediate_size(config),
            out_proj_bias=config.projectors_bias, rms_norm=bool(config.mamba_rms_norm),
            norm_before_gate=bool(config.mamba_norm_before_gate)), layer_idx)
        self.mamba.state.layer_name = f"model.layers.{layer_idx}.mamba"
        self.self_attn = FalconH1Attention(config, layer_idx)
        self.feed_forward = FalconH1MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_in_multiplier = config.attention_in_multiplier
        self.attention_out_multiplier = config.attention_out_multiplier
        self.ssm_out_multiplier = config.ssm_out_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        attn = self.self_attn(positions, h * self.attention_in_multiplier)
        hidden = (hidden + self.mamba(h) * self.ssm_out_multiplier
                  + attn * self.attention_out_multiplier)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class FalconH1ForCausalLM(HybridForCausalLM):
    """Falcon-H1's stack (`model.{embed_tokens,layers,final_layernorm}`) on
    `HybridForCausalLM`; its API. Each mixer's `in_proj` rows are scaled by the muP vector and
    its input multiplier as they load. llama.cpp's `falcon-h1` files (multipliers folded into
    the weights) load through `mamba_hybrid_gguf.falcon_h1_hf_config` /
    `falcon_h1_checkpoint_weights`.

    Raises:
        ValueError: at construction, with tensor / pipeline parallelism or an activation other
            than silu.
    """

    gguf_architecture: str | None = "falcon-h1"

    @classmethod
    def gguf_hf_config(cls, metadata: dict, tensors: dict):
        """The HF config of a `falcon-h1` GGUF file
        (`mamba_hybrid_gguf.falcon_h1_hf_config`)."""
        return falcon_h1_hf_config(metadata, tensors)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """Checkpoint tensors of a `falcon-h1` GGUF file
        (`mamba_hybrid_gguf.falcon_h1_checkpoint_weights`)."""
        return falcon_h1_checkpoint_weights(config, weights, cls.__name__)

    def __init__(self, config) -> None:
        super().__init__(config, None, (), lambda i, _: FalconH1DecoderLayer(config, i),
                         RMSNorm(config.hidden_size, config.rms_norm_eps),
                         norm="final_layernorm",
                         embedding_multiplier=config.embedding_multiplier)
        self.lm_head_multiplier = config.lm_head_multiplier
        self._in_proj_scale = mup_vector(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) * self.lm_head_multiplier

    def checkpoint_tensors(self, name: str, tensor):
        if name.endswith((".mamba.in_proj.weight", ".mamba.in_proj.bias")):
            rows = self._in_proj_scale * (self.config.ssm_in_multiplier
                                          if name.endswith("weight") else 1.0)
            if bool((rows != 1).any()):   # (a GGUF file's rows come scaled: blocks kept)
                # (a checkpoint tensor is read lazily: read it to scale it)
                t = tensor.materialize() if hasattr(tensor, "materialize") else tensor
                tensor = (t.float() * rows.view(-1, *([1] * (t.dim() - 1)))).to(t.dtype)
        return ((name, tensor),)
