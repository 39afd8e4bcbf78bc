"""GLM-4 MoE (`Glm4MoeForCausalLM`, GLM-4.5 / 4.6): standard GQA attention with partial RoPE and
optional per-head q/k RMSNorm, and DeepSeek-V3's MoE.

    attention: Llama's (q/k/v biases per `attention_bias`, no o_proj bias), RoPE on the first
               `partial_rotary_factor` (default 0.5) of each head in GPT-NeoX halves, q/k
               RMSNorm before RoPE when `use_qk_norm`;
    MLP:       dense SwiGLU on layers < `first_k_dense_replace`, else the DeepSeek MoE block
               (sigmoid scores + `e_score_correction_bias`, group-limited noaux_tc top-k,
               `norm_topk_prob`, `routed_scaling_factor`, shared experts): models/deepseek_v2.py.

The checkpoint's multi-token-prediction layer (`num_mtp_layers`) is skipped at load.
llama.cpp's `glm4moe` GGUF files load too (models/deepseek_gguf.py), routed experts kept in
their GGUF blocks as DeepSeek's.
"""

from __future__ import annotations

from torch import nn

from pagedllm.models.deepseek_gguf import (GLM4MOE_TENSOR_NAMES, deepseek2_checkpoint_weights,
                                           glm4moe_hf_config)
from pagedllm.models.deepseek_v2 import DeepseekV3ForCausalLM
from pagedllm.models.llama import LlamaAttention


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4 MoE causal LM (see `MoeForCausalLM` for the API)."""

    gguf_architecture = "glm4moe"

    @classmethod
    def gguf_hf_config(cls, metadata: dict, tensors: dict):
        """The HF config of a `glm4moe` GGUF file (`deepseek_gguf.glm4moe_hf_config`)."""
        return glm4moe_hf_config(metadata, tensors)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """HF-named tensors of a `glm4moe` GGUF file (`deepseek2_checkpoint_weights`)."""
        return deepseek2_checkpoint_weights(config, weights, cls.__name__, GLM4MOE_TENSOR_NAMES)

    stacked_params_mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                              ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                              ("gate_up_proj", "up_proj", 1))

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        return LlamaAttention(config, layer_idx, qk_norm=bool(getattr(config, "use_qk_norm", False)),
                              qkv_bias=bool(getattr(config, "attention_bias", False)),
                              o_bias=False, sliding_window=sliding_window)
