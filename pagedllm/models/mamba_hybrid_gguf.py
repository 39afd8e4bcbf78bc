"""llama.cpp's GGUF files of the Mamba-2 hybrids: `granitehybrid` (Granite 4 hybrid) as
`GraniteMoeHybridForCausalLM` checkpoints and `falcon-h1` as `FalconH1ForCausalLM` checkpoints.
Their Mamba-2 layers' tensors are written by convert_hf_to_gguf.py's Mamba2Model
(`mamba_mixer_tensor` takes them back).

Granite 4 hybrid. The config is read here (transformers' GGUF reader does not know
`granitehybrid`):
- layer types from the per-layer `attention.head_count_kv` array (0: a Mamba-2 layer);
- the Mamba-2 mixer from `ssm.*` (time_step_rank = heads, inner_size = heads x head size,
  group_count, state_size, conv_kernel);
- Granite's multipliers from `embedding_scale`, `residual_scale`, `attention.scale` and
  `logit_scale`;
- the experts from `expert_count` / `expert_used_count` / `feed_forward_length`, the shared
  MLP from `expert_shared_feed_forward_length`;
- RoPE only when `rope.scaling.finetuned` is true. convert_hf_to_gguf.py's GraniteHybridModel
  sets it only for Bamba or for a model without Mamba layers, and llama.cpp (its
  granite-hybrid graph) applies RoPE only then; Granite 4.0-H's own config says "nope".

Tensors (convert_hf_to_gguf.py: Mamba2Model's transforms for the Mamba layers, LlamaModel's for
attention, GraniteMoeModel's split of the fused expert and shared-MLP inputs):
- `ssm_a` holds A = -exp(A_log) as [heads, 1] (A_log = log(-A) back);
- `ssm_d` is [heads, 1], the conv weight squeezed to [conv_dim, K], the gated norm
  [groups, inner / groups];
- `attn_q` / `attn_k` rows are in llama.cpp's interleaved RoPE order (its `undo_permute`,
  taken back with `unpermute_rope_rows`);
- the experts' fused `input_linear` [E, 2I, H] is split into `ffn_gate_exps` and `ffn_up_exps`
  (loaded one expert at a time, so quantized experts keep their blocks);
- `shared_mlp.input_linear` is split into `ffn_gate_shexp` / `ffn_up_shexp` (loaded as the
  two halves of the merged `shared_mlp.input_linear`).

Falcon-H1. convert_hf_to_gguf.py's FalconH1Model folds every muP multiplier into the weights
(`ssm_in` rows by ssm_in_multiplier x the z | x | B | C | dt `ssm_multipliers`, `ssm_out` by
ssm_out_multiplier, q / v by attention_in_multiplier, k by that x key_multiplier, o by
attention_out_multiplier, the MLP's gate / down by `mlp_multipliers`, the embedding and LM head
by theirs), so the config read here sets every multiplier to 1. The gated norm is there when the
file holds `ssm_norm` and is applied after the gate (llama.cpp's Mamba-2 order: a model with
`mamba_norm_before_gate` runs differently in llama.cpp too). Its pre-MLP norm is named
`blk.{i}.ffn_norm`, without the `.weight` suffix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.models.gguf_keys import GGUFKeys, vocab_size
from pagedllm.models.llama import gguf_to_hf_name, unpermute_rope_rows
from pagedllm.models.moe_gguf import expert_checkpoint_weights

# llama.cpp's tensor names -> the names GraniteMoeHybridForCausalLM loads; "{}" is the layer.
GRANITEHYBRID_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.ssm_in": "model.layers.{}.mamba.in_proj",
    "blk.{}.ssm_conv1d": "model.layers.{}.mamba.conv1d",
    "blk.{}.ssm_dt": "model.layers.{}.mamba.dt_bias",   # .bias -> dt_bias itself
    "blk.{}.ssm_norm": "model.layers.{}.mamba.norm",
    "blk.{}.ssm_out": "model.layers.{}.mamba.out_proj",
    "blk.{}.ffn_gate_inp": "model.layers.{}.mlp.gate",
    "blk.{}.ffn_gate_shexp": "model.layers.{}.shared_mlp.gate_proj",
    "blk.{}.ffn_up_shexp": "model.layers.{}.shared_mlp.up_proj",
    "blk.{}.ffn_down_shexp": "model.layers.{}.shared_mlp.output_linear",
}
_SUFFIXLESS = {"ssm_a": "A_log", "ssm_d": "D"}


def granitehybrid_hf_config(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]):
    """The HF `GraniteMoeHybridConfig` of a `granitehybrid` file, with `architectures` set
    (module docstring).

    Raises:
        ValueError: naming a missing key, a head_count_kv array of the wrong length, or Mamba
            sizes that do not divide.
    """
    import transformers

    k = GGUFKeys(metadata, "granitehybrid")
    layers = k.integer("block_count")
    kv = k.get("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    if len(kv) != layers or len({n for n in kv if n}) > 1:
        raise ValueError(f"metadata key granitehybrid.attention.head_count_kv = {kv}: not one "
                         f"count per layer of {layers}, all attention layers alike")
    hidden, heads = k.integer("embedding_length"), k.integer("ssm.time_step_rank")
    inner = k.integer("ssm.inner_size")
    if heads <= 0 or inner % heads or inner % hidden:
        raise ValueError(f"metadata keys granitehybrid.ssm.inner_size = {inner}, "
                         f"granitehybrid.ssm.time_step_rank = {heads}, "
                         f"granitehybrid.embedding_length = {hidden}: the inner size must be a "
                         f"multiple of both")
    use_rope = bool(k.get("rope.scaling.finetuned", False))
    config = transformers.AutoConfig.for_model(
        "granitemoehybrid", vocab_size=vocab_size(k, tensors), hidden_size=hidden,
        num_hidden_layers=layers,
        layer_types=["attention" if n else "mamba" for n in kv],
        num_attention_heads=k.integer("attention.head_count"),
        num_key_value_heads=max(kv) or k.integer("attention.head_count"),
        max_position_embeddings=k.integer("context_length"),
        rms_norm_eps=k.number("attention.layer_norm_rms_epsilon"),
        position_embedding_type="rope" if use_rope else "nope",
        rope_parameters={"rope_type": "default",
                         "rope_theta": k.number("rope.freq_base", 10000.0)},
        intermediate_size=k.integer("feed_forward_length"),
        shared_intermediate_size=k.integer("expert_shared_feed_forward_length", 0),
        num_local_experts=k.integer("expert_count", 0),
        num_experts_per_tok=k.integer("expert_used_count", 0),
        embedding_multiplier=k.number("embedding_scale", 1.0),
        residual_multiplier=k.number("residual_scale", 1.0),
        attention_multiplier=k.number("attention.scale", 1.0),
        logits_scaling=k.number("logit_scale", 1.0),
        mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_expand=inner // hidden,
        mamba_n_groups=k.integer("ssm.group_count", 1), mamba_d_state=k.integer("ssm.state_size"),
        mamba_d_conv=k.integer("ssm.conv_kernel"),
        mamba_conv_bias=any(name.endswith(".ssm_conv1d.bias") for name in tensors),
        mamba_proj_bias=any(name.endswith(".ssm_in.bias") for name in tensors),
        attention_bias=any(name.endswith(".attn_q.bias") for name in tensors),
        tie_word_embeddings="output.weight" not in tensors)
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    return config


def granitehybrid_checkpoint_weights(config, weights: Iterable[tuple[str, Any]],
                                     family: str) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors of a `granitehybrid` file's tensors, named as
    `GraniteMoeHybridForCausalLM` loads them (module docstring); linear layers and experts stay
    lazy GGUF tensors (quantized blocks kept).

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in weights:
        experts = expert_checkpoint_weights(name, tensor)
        if experts is not None:
            yield from experts
            continue
        hf_name, tensor = mamba_mixer_tensor(name, tensor, GRANITEHYBRID_TENSOR_NAMES, family)
        if hf_name.endswith(".self_attn.q_proj.weight"):
            tensor = tensor.map(lambda w: unpermute_rope_rows(w, heads))
        elif hf_name.endswith(".self_attn.k_proj.weight"):
            tensor = tensor.map(lambda w: unpermute_rope_rows(w, kv_heads))
        yield hf_name, tensor


def mamba_mixer_tensor(name: str, tensor, names: dict[str, str], family: str
                       ) -> tuple[str, Any]:
    """The checkpoint name and tensor of one GGUF tensor by `names` (llama.cpp name -> ours,
    "{}" the layer), with Mamba2Model's changes to the mixer's tensors (`model.layers.{i}.mamba`)
    undone: A = -exp(A_log) and D as [heads, 1], `ssm_dt.bias` as the dt bias, the conv weight
    squeezed to [conv_dim, K], the gated norm grouped [groups, inner / groups].

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    layer, _, stem = name.partition(".")[2].partition(".")
    if name.startswith("blk.") and stem in _SUFFIXLESS:
        values = tensor.materialize().reshape(-1)
        if stem == "ssm_a":
            values = torch.log(-values)   # A = -exp(A_log)
        return f"model.layers.{layer}.mamba.{_SUFFIXLESS[stem]}", values
    hf_name = gguf_to_hf_name(name, names)
    if hf_name is None:
        raise ValueError(f"GGUF tensor {name} has no counterpart in {family}")
    if hf_name.endswith(".dt_bias.bias"):
        hf_name = hf_name[:-len(".bias")]
    elif hf_name.endswith(".conv1d.weight") and len(tensor.shape) == 2:
        tensor = tensor.materialize().unsqueeze(1)    # [conv_dim, K] -> [conv_dim, 1, K]
    elif hf_name.endswith(".mamba.norm.weight") and len(tensor.shape) == 2:
        tensor = tensor.materialize().reshape(-1)     # [groups, inner / groups] -> [inner]
    return hf_name, tensor


# llama.cpp's tensor names -> FalconH1ForCausalLM's; "{}" is the layer.
FALCON_H1_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.final_layernorm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.ssm_in": "model.layers.{}.mamba.in_proj",
    "blk.{}.ssm_conv1d": "model.layers.{}.mamba.conv1d",
    "blk.{}.ssm_dt": "model.layers.{}.mamba.dt_bias",
    "blk.{}.ssm_norm": "model.layers.{}.mamba.norm",
    "blk.{}.ssm_out": "model.layers.{}.mamba.out_proj",
    "blk.{}.ffn_gate": "model.layers.{}.feed_forward.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.feed_forward.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.feed_forward.down_proj",
}
_FALCON_H1_FFN_NORM = re.compile(r"blk\.(\d+)\.ffn_norm")


def falcon_h1_hf_config(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]):
    """The HF `FalconH1Config` of a `falcon-h1` file, with `architectures` set and every muP
    multiplier 1 (module docstring).

    Raises:
        ValueError: naming a missing key, or Mamba sizes that do not divide.
    """
    import transformers

    k = GGUFKeys(metadata, "falcon-h1")
    hidden, heads = k.integer("embedding_length"), k.integer("attention.head_count")
    ssm_heads, inner = k.integer("ssm.time_step_rank"), k.integer("ssm.inner_size")
    if ssm_heads <= 0 or inner % ssm_heads:
        raise ValueError(f"metadata keys falcon-h1.ssm.inner_size = {inner}, "
                         f"falcon-h1.ssm.time_step_rank = {ssm_heads}: the inner size must be a "
                         f"multiple of the heads")
    config = transformers.AutoConfig.for_model(
        "falcon_h1", vocab_size=vocab_size(k, tensors), hidden_size=hidden,
        num_hidden_layers=k.integer("block_count"),
        intermediate_size=k.integer("feed_forward_length"),
        num_attention_heads=heads, num_key_value_heads=k.integer("attention.head_count_kv"),
        head_dim=k.integer("attention.key_length", hidden // heads),
        max_position_embeddings=k.integer("context_length"),
        rms_norm_eps=k.number("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default",
                         "rope_theta": k.number("rope.freq_base", 10000.0)},
        mamba_d_ssm=inner, mamba_n_heads=ssm_heads, mamba_d_head=inner // ssm_heads,
        mamba_n_groups=k.integer("ssm.group_count", 1), mamba_d_state=k.integer("ssm.state_size"),
        mamba_d_conv=k.integer("ssm.conv_kernel"),
        mamba_conv_bias=any(name.endswith(".ssm_conv1d.bias") for name in tensors),
        mamba_proj_bias=any(name.endswith(".ssm_in.bias") for name in tensors),
        projectors_bias=any(name.endswith(".ssm_out.bias") for name in tensors),
        mamba_rms_norm=any(name.endswith(".ssm_norm.weight") for name in tensors),
        mamba_norm_before_gate=False,
        attention_bias=any(name.endswith(".attn_q.bias") for name in tensors),
        mlp_bias=any(name.endswith(".ffn_up.bias") for name in tensors),
        embedding_multiplier=1.0, lm_head_multiplier=1.0, mlp_multipliers=[1.0, 1.0],
        key_multiplier=1.0, attention_in_multiplier=1.0, attention_out_multiplier=1.0,
        ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, ssm_multipliers=[1.0] * 5,
        tie_word_embeddings="output.weight" not in tensors)
    config.architectures = ["FalconH1ForCausalLM"]
    return config


def falcon_h1_checkpoint_weights(config, weights: Iterable[tuple[str, Any]],
                                 family: str) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors of a `falcon-h1` file's tensors, named as `FalconH1ForCausalLM` loads
    them (module docstring); linear layers stay lazy GGUF tensors.

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    for name, tensor in weights:
        norm = _FALCON_H1_FFN_NORM.fullmatch(name)
        if norm is not None:   # (no `.weight` suffix in the converter's name)
            yield f"model.layers.{norm[1]}.pre_ff_layernorm.weight", tensor
            continue
        yield mamba_mixer_tensor(name, tensor, FALCON_H1_TENSOR_NAMES, family)
