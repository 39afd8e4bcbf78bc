"""GLM-4 MoE (`Glm4MoeForCausalLM`, GLM-4.5 / 4.6): standard GQA attention with partial RoPE and
optional per-head q/k RMSNorm, and DeepSeek-V3's MoE.

    attention: Llama's (q/k/v biases per `attention_bias`, no o_proj bias), RoPE on the first
               `partial_rotary_factor` (default 0.5) of each head in GPT-NeoX halves, q/k
               RMSNorm before RoPE when `use_qk_norm`;
    MLP:       dense SwiGLU on layers < `first_k_dense_replace`, else the DeepSeek MoE block
               (sigmoid scores + `e_score_correction_bias`, group-limited noaux_tc top-k,
               `norm_topk_prob`, `routed_scaling_factor`, shared experts): models/deepseek_v2.py.

The checkpoint's multi-token-prediction layer (`num_mtp_layers`) is skipped at load.
"""

from __future__ import annotations

from torch import nn

from pagedllm.models.deepseek_v2 import DeepseekV3ForCausalLM
from pagedllm.models.llama import LlamaAttention


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4 MoE causal LM (see `MoeForCausalLM` for the API)."""

    gguf_architecture = None   # llama.cpp's glm4moe files are not read (yet)

    stacked_params_mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                              ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                              ("gate_up_proj", "up_proj", 1))

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        return LlamaAttention(config, layer_idx, qk_norm=bool(getattr(config, "use_qk_norm", False)),
                              qkv_bias=bool(getattr(config, "attention_bias", False)),
                              o_bias=False, sliding_window=sliding_window)
