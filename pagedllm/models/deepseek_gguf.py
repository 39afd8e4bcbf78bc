"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2 / V2-Lite / V3 and their conversions) as
checkpoints of `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`, and its `glm4moe` files as
checkpoints of `Glm4MoeForCausalLM` (DeepSeek-V3's MoE under GQA attention): the HF config from
the file's metadata and the file's tensors under HF names.

Config (llama.cpp's `deepseek2.*` keys, as convert_hf_to_gguf.py's DeepseekV2Model writes them):

    attention.q_lora_rank (absent: none)      kv_lora_rank       rope.dimension_count = rope dim
    attention.key_length_mla / value_length_mla = nope + rope / v head dims (older files without
        the split: attention.key_length / value_length)
    leading_dense_block_count = first_k_dense_replace    expert_feed_forward_length, expert_count,
    expert_used_count, expert_shared_count, expert_weights_scale (1), expert_weights_norm (false),
    expert_group_count / expert_group_used_count, expert_gating_func (absent or 1: softmax, V2;
        2: sigmoid with exp_probs_b, V3 "noaux_tc"; others refused)
    rope.scaling.type yarn: factor, original_context_length, yarn_beta_fast/slow,
        yarn_log_multiplier = 0.1 * mscale_all_dim

NOTE(gguf): files store one YaRN mscale (`mscale_all_dim`); HF's `mscale` is taken equal to
it, as in every released DeepSeek config (V2-Lite: 0.707 and 0.707), so a checkpoint with
different values does not survive conversion. Softmax routing with expert groups is read as
V2's "group_limited_greedy" (the released V2 files); llama.cpp itself scores groups by their
top-2 sum, V3's rule, for both.

Tensors: `attn_k_b` [H, kv_lora_rank, nope] (W_UK transposed per head) and `attn_v_b`
[H, v, kv_lora_rank] are put back together as HF's `kv_b_proj` [H * (nope + v), kv_lora_rank]
(older files' `attn_kv_b` is that already); stacked `ffn_{gate,up,down}_exps` [E, ...] yield one
lazy tensor per expert (`GGUFTensor.expert`), so quantized experts stay in their blocks
(layers/quantization/gguf_moe.py). No Q/K row permutation: DeepSeek's RoPE is interleaved in
both layouts. MTP blocks past `block_count` (converted only by newer tools) are skipped.

`glm4moe` (convert_hf_to_gguf.py's Glm4MoeModel): `block_count` counts the MTP blocks too, so
num_hidden_layers = block_count - `nextn_predict_layers`, and those blocks are skipped;
head_dim = `attention.key_length`, partial_rotary_factor = `rope.dimension_count` / head_dim;
q/k norms and q/k/v biases from their tensors' presence (`attn_q_norm`, `attn_q.bias`);
`post_attention_norm` is HF's post_attention_layernorm; the routing keys are deepseek2's
(sigmoid only: GLM-4 MoE has no other). No Q/K row permutation (NeoX halves in both layouts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.models.gguf_keys import GGUFKeys, vocab_size
from pagedllm.models.llama import gguf_to_hf_name
from pagedllm.models.moe_gguf import expert_checkpoint_weights

# llama.cpp's tensor names -> HF checkpoint names; "{}" is the layer index.
DEEPSEEK2_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_q_a": "model.layers.{}.self_attn.q_a_proj",
    "blk.{}.attn_q_a_norm": "model.layers.{}.self_attn.q_a_layernorm",
    "blk.{}.attn_q_b": "model.layers.{}.self_attn.q_b_proj",
    "blk.{}.attn_kv_a_mqa": "model.layers.{}.self_attn.kv_a_proj_with_mqa",
    "blk.{}.attn_kv_a_norm": "model.layers.{}.self_attn.kv_a_layernorm",
    "blk.{}.attn_kv_b": "model.layers.{}.self_attn.kv_b_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
    "blk.{}.ffn_gate_inp": "model.layers.{}.mlp.gate",
    "blk.{}.exp_probs_b": "model.layers.{}.mlp.gate",   # .bias -> e_score_correction_bias
    "blk.{}.ffn_gate_shexp": "model.layers.{}.mlp.shared_experts.gate_proj",
    "blk.{}.ffn_up_shexp": "model.layers.{}.mlp.shared_experts.up_proj",
    "blk.{}.ffn_down_shexp": "model.layers.{}.mlp.shared_experts.down_proj",
}
# glm4moe: Llama's attention names (biases, q/k norms) plus deepseek2's MoE names.
GLM4MOE_TENSOR_NAMES = {
    **{k: v for k, v in DEEPSEEK2_TENSOR_NAMES.items()
       if ".attn_" not in k and k != "blk.{}.ffn_norm"},
    **{f"blk.{{}}.{stem}": f"model.layers.{{}}.self_attn.{hf}"
       for stem, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                        ("attn_output", "o_proj"), ("attn_q_norm", "q_norm"),
                        ("attn_k_norm", "k_norm"))},
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
}
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_* values.
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_BLOCK = re.compile(r"blk\.(\d+)\.")   # any tensor of a block (MTP's `nextn.*` too)


def deepseek2_hf_config(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]):
    """The HF config (`DeepseekV2Config`, or `DeepseekV3Config` for sigmoid gating) of a
    `deepseek2` file, with `architectures` set.

    Args:
        metadata: the file's metadata (`model_loader.gguf.metadata_values`).
        tensors: tensor name -> torch-order shape.

    Raises:
        ValueError: naming a missing key or an unsupported value (gating function, RoPE
            scaling type).
    """
    import transformers

    k = GGUFKeys(metadata, "deepseek2")
    rope_dim = k.integer("rope.dimension_count")
    qk_head = k.integer("attention.key_length_mla", None) or k.integer("attention.key_length")
    v_head = k.integer("attention.value_length_mla", None) or k.integer("attention.value_length")
    gating = k.integer("expert_gating_func", 1)
    if gating not in _GATING_FUNCS:
        raise ValueError(f"metadata key deepseek2.expert_gating_func = {gating} is not supported "
                         f"(supported: {_GATING_FUNCS})")
    scoring = _GATING_FUNCS[gating]
    n_group = k.integer("expert_group_count", None)
    topk_group = k.integer("expert_group_used_count", None)
    if scoring == "sigmoid":
        arch, model_type, topk_method = "DeepseekV3ForCausalLM", "deepseek_v3", "noaux_tc"
        n_group, topk_group = n_group or 1, topk_group or 1
    else:
        arch, model_type = "DeepseekV2ForCausalLM", "deepseek_v2"
        topk_method = "group_limited_greedy" if (n_group or 1) > 1 else "greedy"
    heads = k.integer("attention.head_count")
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size(k, tensors),
        hidden_size=k.integer("embedding_length"),
        intermediate_size=k.integer("feed_forward_length"),
        moe_intermediate_size=k.integer("expert_feed_forward_length"),
        num_hidden_layers=k.integer("block_count"),
        num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=k.integer("context_length"),
        rms_norm_eps=k.number("attention.layer_norm_rms_epsilon"),
        q_lora_rank=k.integer("attention.q_lora_rank", None),
        kv_lora_rank=k.integer("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head - rope_dim, v_head_dim=v_head,
        **_deepseek_moe_fields(k),
        n_group=n_group, topk_group=topk_group, topk_method=topk_method,
        rope_parameters=_rope_parameters(k),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=False, hidden_act="silu")
    config.architectures = [arch]
    return config


def _deepseek_moe_fields(k: GGUFKeys) -> dict[str, Any]:
    """The DeepSeek-MoE config fields both `deepseek2` and `glm4moe` files store under the same
    keys: expert counts, dense leading layers, routed scaling and top-k renormalisation.

    Raises:
        ValueError: naming a missing expert_count / expert_used_count key.
    """
    return dict(n_routed_experts=k.integer("expert_count"),
                num_experts_per_tok=k.integer("expert_used_count"),
                n_shared_experts=k.integer("expert_shared_count", 0),
                first_k_dense_replace=k.integer("leading_dense_block_count", 0),
                routed_scaling_factor=k.number("expert_weights_scale", 1.0),
                norm_topk_prob=bool(k.get("expert_weights_norm", False)))


def glm4moe_hf_config(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]):
    """The HF config (`Glm4MoeConfig`, architectures set) of a `glm4moe` file (module
    docstring).

    Raises:
        ValueError: naming a missing key, a gating function other than sigmoid (2), more MTP
            blocks than blocks, or a RoPE scaling type.
    """
    import transformers

    k = GGUFKeys(metadata, "glm4moe")
    gating = k.integer("expert_gating_func", 2)
    if gating != 2:
        raise ValueError(f"metadata key glm4moe.expert_gating_func = {gating} is not supported "
                         f"(GLM-4 MoE routes with sigmoid scores, 2)")
    nextn = k.integer("nextn_predict_layers", 0)
    num_layers = k.integer("block_count") - nextn
    if num_layers < 1:
        raise ValueError(f"metadata keys glm4moe.block_count = {k.integer('block_count')} and "
                         f"glm4moe.nextn_predict_layers = {nextn} leave no decoder layer")
    heads = k.integer("attention.head_count")
    head_dim = k.integer("attention.key_length", None) or k.integer("embedding_length") // heads
    rope = _rope_parameters(k)
    if rope["rope_type"] != "default":
        raise ValueError(f"metadata key glm4moe.rope.scaling.type = {rope['rope_type']!r} is "
                         f"not supported for glm4moe (supported: none)")
    rope["partial_rotary_factor"] = k.integer("rope.dimension_count", head_dim // 2) / head_dim
    config = transformers.AutoConfig.for_model(
        "glm4_moe",
        vocab_size=vocab_size(k, tensors),
        hidden_size=k.integer("embedding_length"),
        intermediate_size=k.integer("feed_forward_length"),
        moe_intermediate_size=k.integer("expert_feed_forward_length"),
        num_hidden_layers=num_layers, num_nextn_predict_layers=nextn,
        num_attention_heads=heads, num_key_value_heads=k.integer("attention.head_count_kv"),
        head_dim=head_dim,
        max_position_embeddings=k.integer("context_length"),
        rms_norm_eps=k.number("attention.layer_norm_rms_epsilon"),
        **_deepseek_moe_fields(k),
        n_group=k.integer("expert_group_count", None) or 1,
        topk_group=k.integer("expert_group_used_count", None) or 1,
        use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_parameters=rope, tie_word_embeddings="output.weight" not in tensors,
        hidden_act="silu")
    config.architectures = ["Glm4MoeForCausalLM"]
    return config


def _rope_parameters(k: GGUFKeys) -> dict[str, Any]:
    """HF `rope_parameters` from `rope.freq_base` and the `rope.scaling.*` keys.

    Raises:
        ValueError: a scaling type other than none / yarn, naming the key.
    """
    theta = k.number("rope.freq_base", 10000.0)
    scaling = k.get("rope.scaling.type", "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise ValueError(f"metadata key {k.arch}.rope.scaling.type = {scaling!r} is not "
                         f"supported (supported: none, yarn)")
    params = {"rope_type": "yarn", "rope_theta": theta,
              "factor": k.number("rope.scaling.factor"),
              "original_max_position_embeddings":
                  k.integer("rope.scaling.original_context_length"),
              "beta_fast": k.number("rope.scaling.yarn_beta_fast", 32.0),
              "beta_slow": k.number("rope.scaling.yarn_beta_slow", 1.0)}
    log_mul = k.number("rope.scaling.yarn_log_multiplier", None)
    if log_mul is not None:
        params["mscale"] = params["mscale_all_dim"] = log_mul / 0.1
    return params


def deepseek2_checkpoint_weights(config, weights: Iterable[tuple[str, Any]], family: str,
                                 names: dict[str, str] = DEEPSEEK2_TENSOR_NAMES
                                 ) -> Iterator[tuple[str, Any]]:
    """HF-named checkpoint tensors of a `deepseek2` (or, with GLM4MOE_TENSOR_NAMES, a
    `glm4moe`) file's tensors (module docstring).

    Args:
        config: the HF config (head count, head dims, layer count).
        weights: (llama.cpp name, lazy GGUF tensor), as `iterate_gguf_tensors` yields them.
        family: the class name, for messages.
        names: llama.cpp -> HF names of the tensors that are not experts.

    Raises:
        ValueError: naming a tensor with no counterpart, or a layer with only one of
            attn_k_b / attn_v_b.
    """
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    pending: dict[int, dict[str, Any]] = {}   # layer -> {"attn_k_b": t, "attn_v_b": t}
    for name, tensor in weights:
        block = _BLOCK.match(name)
        if block is not None and int(block[1]) >= layers:
            continue   # an MTP block (nextn): the "mtp" drafter is not loaded from GGUF
        layer = _LAYER.fullmatch(name)
        if layer is not None and layer[2] in ("attn_k_b", "attn_v_b"):
            parts = pending.setdefault(int(layer[1]), {})
            parts[layer[2]] = tensor
            if len(parts) == 2:
                del pending[int(layer[1])]
                yield (f"model.layers.{layer[1]}.self_attn.kv_b_proj.weight",
                       _merge_kv_b(parts["attn_k_b"], parts["attn_v_b"], heads))
            continue
        experts = expert_checkpoint_weights(name, tensor)
        if experts is not None:
            yield from experts
            continue
        hf_name = gguf_to_hf_name(name, names)
        if hf_name is None:
            raise ValueError(f"GGUF tensor {name} has no counterpart in {family}")
        if hf_name.endswith(".mlp.gate.bias"):
            hf_name = hf_name[:-len("bias")] + "e_score_correction_bias"
        yield hf_name, tensor
    if pending:
        layer, parts = next(iter(pending.items()))
        missing = ({"attn_k_b", "attn_v_b"} - set(parts)).pop()
        raise ValueError(f"GGUF tensor blk.{layer}.{missing}.weight is missing (its layer has "
                         f"only {', '.join(parts)})")


def _merge_kv_b(k_b, v_b, heads: int) -> torch.Tensor:
    """kv_b_proj [H * (nope + v), r] from attn_k_b [H, r, nope] and attn_v_b [H, v, r].

    Raises:
        ValueError: shapes that do not fit together, naming both tensors.
    """
    if len(k_b.shape) != 3 or len(v_b.shape) != 3 or k_b.shape[0] != heads \
            or v_b.shape[0] != heads or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"GGUF tensors {k_b.name} {tuple(k_b.shape)} and {v_b.name} "
                         f"{tuple(v_b.shape)} are not [heads={heads}, kv_lora_rank, nope] and "
                         f"[heads, v, kv_lora_rank]")
    w_uk = k_b.materialize().transpose(1, 2)            # [H, nope, r]
    kv_b = torch.cat((w_uk, v_b.materialize()), dim=1)  # [H, nope + v, r]
    return kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
