"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a sparse MoE block in every layer.

Every layer routes each token to `num_experts_per_tok` of `num_local_experts` SwiGLU experts
(softmax, top-k, renormalised: HF's MixtralTopKRouter) and applies the config's
`sliding_window` (None: none) on every layer, as Mistral does. The checkpoint keeps the block
as `block_sparse_moe` (`gate`, `experts.{e}.w1/w2/w3`), renamed to our `mlp` at load.
"""

from __future__ import annotations

from torch import nn

from pagedllm.models.llama import LlamaAttention
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral causal LM (see `MoeForCausalLM` for the API)."""

    sliding_window_rule = "all"
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        return LlamaAttention(config, layer_idx, qk_norm=False, qkv_bias=False, o_bias=False,
                              sliding_window=sliding_window)

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_local_experts,
                              config.num_experts_per_tok, config.intermediate_size,
                              renormalize=True, hidden_act=config.hidden_act)
