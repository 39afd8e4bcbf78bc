"""Qwen2-MoE (`Qwen2MoeForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`).

Both route with softmax then top-k, renormalising the k weights only when the config's
`norm_topk_prob` says so, and keep a dense SwiGLU MLP (`intermediate_size`) on the layers HF
makes dense: those listed in `mlp_only_layers`, and every layer i with
(i + 1) % `decoder_sparse_step` != 0. Qwen2-MoE adds to every sparse block a shared expert
(`shared_expert_intermediate_size`) scaled by sigmoid(`shared_expert_gate`(x)) and has q/k/v
biases (`qkv_bias`, default on); Qwen3-MoE has per-head q/k RMSNorm (as Qwen3) and no shared
expert. Sliding windows follow HF: Qwen2-MoE per layer by `layer_types`, Qwen3-MoE on every
layer when `use_sliding_window`.
"""

from __future__ import annotations

from torch import nn

from pagedllm.models.llama import LlamaAttention, LlamaMLP
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock
from pagedllm.models.moe_gguf import qwen_moe_checkpoint_weights


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether HF gives layer `layer_idx` a sparse MoE block (else a dense MLP)."""
    mlp_only = getattr(config, "mlp_only_layers", None) or ()
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in mlp_only and config.num_experts > 0
            and (layer_idx + 1) % step == 0)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE causal LM (see `MoeForCausalLM` for the API)."""

    sliding_window_rule = "qwen"
    # A shared expert beside the routed ones (Qwen2-MoE).
    shared_expert = True
    # NOTE(gguf): `qwen2moe` files are not read yet (the name map covers the shared expert, but
    # no file was checked: llama.cpp's converter refuses the tiny test checkpoints, whose
    # dense layers it cannot map).
    gguf_architecture: str | None = None

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """HF-named tensors of a GGUF file (`moe_gguf.qwen_moe_checkpoint_weights`)."""
        return qwen_moe_checkpoint_weights(weights, cls.__name__)

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        return LlamaAttention(config, layer_idx, qk_norm=False,
                              qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False,
                              sliding_window=sliding_window)

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        shared = config.shared_expert_intermediate_size if cls.shared_expert else None
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob),
                              config.hidden_act, shared_expert_intermediate_size=shared)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE causal LM (see `MoeForCausalLM` for the API)."""

    sliding_window_rule = "all"
    shared_expert = False
    gguf_architecture = "qwen3moe"

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, layer_idx, qk_norm=True, qkv_bias=bias, o_bias=bias,
                              sliding_window=sliding_window)
