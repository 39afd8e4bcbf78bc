"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet layers with gated attention every few
layers, and a mixture of experts with a shared expert.

    embed -> [ RMSNorm -> (GatedDeltaNet | gated attention) -> +res
               -> RMSNorm -> (sparse MoE + shared expert | dense MLP) -> +res ] x L
          -> RMSNorm -> LM head                 (RMSNorms: x * (1 + w), zero-centred weights)

    GatedDeltaNet:  in_proj_qkv -> [q | k | v];  in_proj_z -> z;  in_proj_b -> b, in_proj_a -> a
                    [q|k|v] -> causal depthwise conv1d (window state) -> silu
                    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
                    o = gated delta rule(q, k, v, g, beta) (recurrent state [H_v, d_k, d_v])
                    out_proj(RMSNorm(o) * silu(z))              (layers/gated_delta_ops.py)
    gated attention: q_proj -> [q | gate] per head; q/k RMSNorm, partial RoPE, GQA over the
                     paged KV cache; o_proj(attn * sigmoid(gate))

`config.layer_types` ("linear_attention" / "full_attention") says which layer is which. HF
transformers' Qwen3-Next torch path is the oracle.

Qwen3-Next's checkpoints fuse the Gated DeltaNet's input projections, grouped per key head:
`in_proj_qkvz` rows [q | k | v of its value heads | z of them] per key head, `in_proj_ba` rows
[b | a of its value heads] per key head. They are re-ordered as they load into the separate
projections above (`split_grouped_rows`; q, k, v contiguous, value heads in order), the layout
of Qwen3.5's checkpoints and of llama.cpp's `qwen3next` files (its converter splits
`in_proj_qkvz` the same way into `attn_qkv` and `attn_gate`), so no step re-orders them.

Qwen3.5's text model (`Qwen3_5ForCausalLM`) is the same stack with those separate projections
in its checkpoints and dense MLPs only. Its multimodal RoPE (interleaved sections) is plain RoPE
for text, where the three position components are equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

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
from pagedllm.models.hybrid_gguf import (qwen35_checkpoint_weights, qwen35_hf_config,
                                          qwen3next_checkpoint_weights, qwen3next_hf_config)
from pagedllm.models.llama import LlamaMLP
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.models.qwen_moe import is_sparse_layer

LAYER_TYPES = ("linear_attention", "full_attention")


def _param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


def grouped_rows_order(num_groups: int, sizes: Sequence[int]) -> torch.Tensor:
    """[num_groups * sum(sizes)] int64: the row order that turns rows grouped as
    [part 0 | part 1 | ...] per group (part i of `sizes[i]` rows) into [part 0 of every group |
    part 1 of every group | ...]."""
    rows = torch.arange(num_groups * sum(sizes)).view(num_groups, sum(sizes))
    return torch.cat([part.reshape(-1) for part in rows.split(list(sizes), dim=1)])


def split_grouped_rows(tensor: Any, num_groups: int, sizes: Sequence[int],
                       parts: Sequence[int]) -> list[Any]:
    """Re-order a checkpoint tensor's rows by `grouped_rows_order` and cut them into `parts`
    (row counts): a GGUF tensor stays lazy (a row map, then row slices: quantized blocks stay
    blocks), any other is read first.

    Raises:
        ValueError: when the groups or `parts` do not add up to the tensor's rows.
    """
    order = grouped_rows_order(num_groups, sizes)
    if sum(parts) != tensor.shape[0] or len(order) != tensor.shape[0]:
        raise ValueError(f"a tensor of {tensor.shape[0]} rows cannot be split into {list(parts)} "
                         f"({num_groups} groups of {list(sizes)} rows)")
    if hasattr(tensor, "map"):   # model_loader.gguf.GGUFTensor
        whole = tensor.map(lambda t: t[order])
    else:
        whole = (tensor.materialize() if hasattr(tensor, "materialize") else tensor)[order]
    out, start = [], 0
    for rows in parts:
        out.append(whole.narrow(0, start, rows))
        start += rows
    return out


class GatedDeltaNet(nn.Module):
    """hidden [n, hidden_size] -> [n, hidden_size] over the state cache."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
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
        self.in_proj_qkv = ColumnParallelLinear(hidden, self.conv_dim)
        self.in_proj_z = ColumnParallelLinear(hidden, self.value_dim)
        self.in_proj_b = ColumnParallelLinear(hidden, self.num_v_heads)
        self.in_proj_a = ColumnParallelLinear(hidden, self.num_v_heads)
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

    def grouped_checkpoint_tensors(self, name: str, tensor) -> list[tuple[str, Any]]:
        """Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` (`name` ends in
        "in_proj_qkvz.weight" or "in_proj_ba.weight") as (name, tensor) of the separate
        projections (module docstring)."""
        per = self.num_v_heads // self.num_k_heads
        prefix = name.rsplit(".", 2)[0]
        if name.endswith("in_proj_qkvz.weight"):
            sizes = (self.head_k_dim, self.head_k_dim, per * self.head_v_dim,
                     per * self.head_v_dim)
            qkv, z = split_grouped_rows(tensor, self.num_k_heads, sizes,
                                        (self.conv_dim, self.value_dim))
            return [(f"{prefix}.in_proj_qkv.weight", qkv), (f"{prefix}.in_proj_z.weight", z)]
        b, a = split_grouped_rows(tensor, self.num_k_heads, (per, per),
                                  (self.num_v_heads, self.num_v_heads))
        return [(f"{prefix}.in_proj_b.weight", b), (f"{prefix}.in_proj_a.weight", a)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = self.state.metadata()
        conv_state, recurrent_state = self.state.states
        n = hidden.shape[0]
        qkv = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden).view(n, self.num_v_heads, self.head_v_dim)
        b, a = self.in_proj_b(hidden), self.in_proj_a(hidden)
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
    def __init__(self, config, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.is_attention_layer = layer_type == "full_attention"
        if self.is_attention_layer:
            self.self_attn = GatedAttention(config, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        if getattr(config, "num_experts", 0) and is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                      config.num_experts_per_tok, config.moe_intermediate_size,
                                      bool(config.norm_topk_prob), config.hidden_act,
                                      config.shared_expert_intermediate_size)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # A faster replacement of the layer's first half (input norm, mixer, residual add,
        # post-attention norm) for the steps it takes, attached after loading
        # (native/gdn_decoder.py); it returns None for the others. None: the modules run.
        self.native_mixer: Callable[[torch.Tensor, torch.Tensor],
                                    tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        native = self.native_mixer
        if native is not None:
            taken = native(positions, hidden)
            if taken is not None:
                hidden, normed = taken
                return hidden + self.mlp(normed)
        h = self.input_layernorm(hidden)
        h = self.self_attn(positions, h) if self.is_attention_layer else self.linear_attn(h)
        hidden = hidden + h
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Qwen3-Next's stack (`model.{embed_tokens,layers,norm}`) on `HybridForCausalLM`; its API.
    The grouped `in_proj_qkvz` / `in_proj_ba` load re-ordered (module docstring); MTP tensors
    of released checkpoints are skipped (no MTP drafter here). llama.cpp's `qwen3next` files
    load through `hybrid_gguf.qwen3next_hf_config` / `qwen3next_checkpoint_weights`.

    Raises:
        ValueError: at construction, for a layer type other than "linear_attention" /
            "full_attention" (naming it), or with tensor / pipeline parallelism.
    """

    stacked_params_mapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    skipped_weight_prefixes = ("mtp.",)
    gguf_architecture: str | None = "qwen3next"

    @classmethod
    def gguf_hf_config(cls, metadata: dict, tensors: dict):
        """The HF config of a `qwen3next` GGUF file (`hybrid_gguf.qwen3next_hf_config`)."""
        return qwen3next_hf_config(metadata, tensors)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """HF-named tensors of a `qwen3next` GGUF file
        (`hybrid_gguf.qwen3next_checkpoint_weights`)."""
        return qwen3next_checkpoint_weights(config, weights, cls.__name__)

    def __init__(self, config) -> None:
        super().__init__(config, config.layer_types, LAYER_TYPES,
                         lambda i, t: Qwen3NextDecoderLayer(config, i, t),
                         GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))

    def checkpoint_tensors(self, name: str, tensor) -> Iterable[tuple[str, Any]]:
        if name.endswith((".linear_attn.in_proj_qkvz.weight", ".linear_attn.in_proj_ba.weight")):
            layer = name.split(".")[2]
            if name.startswith("model.layers.") and layer.isdigit() \
                    and int(layer) < len(self.model.layers) \
                    and hasattr(self.model.layers[int(layer)], "linear_attn"):
                return self.model.layers[int(layer)].linear_attn.grouped_checkpoint_tensors(
                    name, tensor)
        return ((name, tensor),)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's text model (see the module docstring); the API of `Qwen3NextForCausalLM`.
    llama.cpp's `qwen35` files load through `hybrid_gguf.qwen35_hf_config` /
    `qwen35_checkpoint_weights`."""

    gguf_architecture = "qwen35"

    @classmethod
    def gguf_hf_config(cls, metadata: dict, tensors: dict):
        """The HF config of a `qwen35` GGUF file (`hybrid_gguf.qwen35_hf_config`)."""
        return qwen35_hf_config(metadata, tensors)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """HF-named tensors of a `qwen35` GGUF file (`hybrid_gguf.qwen35_checkpoint_weights`)."""
        return qwen35_checkpoint_weights(config, weights, cls.__name__)
