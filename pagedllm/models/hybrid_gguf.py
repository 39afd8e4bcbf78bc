"""llama.cpp's GGUF files of the hybrid families: `lfm2` (LFM2's short-conv / attention
layers) as `Lfm2ForCausalLM` checkpoints, `mamba2` as `Mamba2ForCausalLM` checkpoints,
`qwen3next` as `Qwen3NextForCausalLM` checkpoints, `qwen35` (Qwen3.5's dense text model) as
`Qwen3_5ForCausalLM` checkpoints. (Granite 4 hybrid and Falcon-H1: models/mamba_hybrid_gguf.py.)

LFM2's config comes from transformers' own GGUF reader (it knows `lfm2`: the per-layer
`attention.head_count_kv` array gives the attention layers); the tensors are renamed here.
convert_hf_to_gguf.py's LFM2Model squeezes the conv weight [hidden, 1, L] to [hidden, L]
(unsqueezed back), stores the final norm (`model.embedding_norm`) as `token_embd_norm` and
permutes nothing (LFM2's RoPE is GPT-NeoX style in both layouts).

Mamba-2's config is read here (transformers' GGUF reader knows only Mamba-1): `mamba2.ssm.*`
(conv_kernel, inner_size, state_size, time_step_rank = heads, group_count) and the RMS eps.
The converter stores A = -exp(A_log) as `ssm_a` [heads, 1] (A_log = log(-A) back), D as
[heads, 1], the conv weight squeezed to [conv_dim, L] and the gated norm as [groups,
inner / groups]. Files keep neither HF's scan `chunk_size` (the default 256 is used: the scan's
chunking changes only the order of float sums) nor `time_step_limit` (HF's default (0, inf),
which llama.cpp applies too).

Qwen3-Next's config is read here too (transformers' GGUF reader does not know `qwen3next`):
the layer types from `attention.recurrent_layers` (one flag per block, as the current converter
writes them) or else `full_attention_interval` (layer i is full attention when (i + 1) is a
multiple of it; llama.cpp's default 4), the Gated DeltaNet's sizes from `ssm.*` (group_count =
key heads, time_step_rank = value heads, state_size = key head size, inner_size = value heads x
value head size), RoPE's fraction from `rope.dimension_count` / `attention.key_length`; every
layer is sparse (llama.cpp requires a router in each) and the top-k weights are renormalised
(llama.cpp always does). convert_hf_to_gguf.py's Qwen3NextModel stores every RMSNorm weight but
the Gated DeltaNet's gated norm as 1 + w (the engine's norms take w: 1 is subtracted back),
A = -exp(A_log) as `ssm_a`, `dt_bias` as `ssm_dt.bias`, the conv weight squeezed, and splits the
grouped `in_proj_qkvz` into `attn_qkv` [q | k | v] and `attn_gate` (z): the engine's own layout
(models/qwen3_next.py). Files of its earlier converter keep `in_proj_qkvz` whole as `ssm_in`;
both load. `ssm_ba` is HF's grouped `in_proj_ba`; the stacked experts load one expert at a time
(models/moe_gguf.py), so quantized experts keep their blocks. Later converters append the MTP
layers as `nextn_predict_layers` extra blocks after the model's: they are counted out of the
layers and their tensors skipped (no MTP drafter here, as for a safetensors checkpoint's
`mtp.*`).

Qwen3.5 (`qwen35`): the same keys and value changes with dense MLPs (`ffn_gate` / `ffn_up` /
`ffn_down`) and `in_proj_b` / `in_proj_a` as `ssm_beta` / `ssm_alpha`; with more value heads
than key heads the converter (`_LinearAttentionVReorderBase`) tiles the value heads for ggml's
broadcast, which `qwen35_checkpoint_weights` undoes (`tiled_value_heads_order`). Its
`rope.dimension_sections` (multimodal RoPE) are not read: for text, sectioned RoPE is plain
RoPE.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.models.gguf_keys import GGUFKeys, vocab_size
from pagedllm.models.llama import gguf_to_hf_name
from pagedllm.models.moe_gguf import QWEN_MOE_TENSOR_NAMES, qwen_moe_checkpoint_weights

# llama.cpp's tensor names -> HF checkpoint names for LFM2; "{}" is the layer index.
LFM2_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "token_embd_norm": "model.embedding_norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.operator_norm",
    "blk.{}.ffn_norm": "model.layers.{}.ffn_norm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.out_proj",
    "blk.{}.attn_q_norm": "model.layers.{}.self_attn.q_layernorm",
    "blk.{}.attn_k_norm": "model.layers.{}.self_attn.k_layernorm",
    "blk.{}.shortconv.conv": "model.layers.{}.conv.conv",
    "blk.{}.shortconv.in_proj": "model.layers.{}.conv.in_proj",
    "blk.{}.shortconv.out_proj": "model.layers.{}.conv.out_proj",
    "blk.{}.ffn_gate": "model.layers.{}.feed_forward.w1",
    "blk.{}.ffn_down": "model.layers.{}.feed_forward.w2",
    "blk.{}.ffn_up": "model.layers.{}.feed_forward.w3",
}


def lfm2_checkpoint_weights(weights: Iterable[tuple[str, Any]],
                            family: str) -> Iterator[tuple[str, Any]]:
    """HF-named checkpoint tensors of an `lfm2` file's tensors (module docstring).

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    for name, tensor in weights:
        hf_name = gguf_to_hf_name(name, LFM2_TENSOR_NAMES)
        if hf_name is None:
            raise ValueError(f"GGUF tensor {name} has no counterpart in {family}")
        if hf_name.endswith(".conv.conv.weight") and len(tensor.shape) == 2:
            tensor = tensor.materialize().unsqueeze(1)   # [hidden, L] -> [hidden, 1, L]
        yield hf_name, tensor


# llama.cpp's tensor names -> HF checkpoint names for Mamba-2; "{}" is the layer index.
MAMBA2_TENSOR_NAMES = {
    "token_embd": "backbone.embeddings",
    "output_norm": "backbone.norm_f",
    "output": "lm_head",
    "blk.{}.attn_norm": "backbone.layers.{}.norm",
    "blk.{}.ssm_in": "backbone.layers.{}.mixer.in_proj",
    "blk.{}.ssm_conv1d": "backbone.layers.{}.mixer.conv1d",
    "blk.{}.ssm_dt": "backbone.layers.{}.mixer.dt_bias",   # .bias -> dt_bias itself
    "blk.{}.ssm_norm": "backbone.layers.{}.mixer.norm",
    "blk.{}.ssm_out": "backbone.layers.{}.mixer.out_proj",
}
_MAMBA2_SUFFIXLESS = {"ssm_a": "A_log", "ssm_d": "D"}


def mamba2_hf_config(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]):
    """The HF `Mamba2Config` of a `mamba2` file, with `architectures` set.

    Raises:
        ValueError: naming a missing key, or an inner size the head count does not divide.
    """
    import transformers

    k = GGUFKeys(metadata, "mamba2")
    hidden, inner = k.integer("embedding_length"), k.integer("ssm.inner_size")
    heads = k.integer("ssm.time_step_rank")
    if heads <= 0 or inner % heads or inner % hidden:
        raise ValueError(f"metadata keys mamba2.ssm.inner_size = {inner}, "
                         f"mamba2.ssm.time_step_rank = {heads}, mamba2.embedding_length = "
                         f"{hidden}: the inner size must be a multiple of both")
    config = transformers.AutoConfig.for_model(
        "mamba2", vocab_size=vocab_size(k, tensors), hidden_size=hidden,
        num_hidden_layers=k.integer("block_count"), intermediate_size=inner,
        expand=inner // hidden, num_heads=heads, head_dim=inner // heads,
        state_size=k.integer("ssm.state_size"), conv_kernel=k.integer("ssm.conv_kernel"),
        n_groups=k.integer("ssm.group_count", 1),
        layer_norm_epsilon=k.number("attention.layer_norm_rms_epsilon"),
        use_conv_bias="blk.0.ssm_conv1d.bias" in tensors, use_bias="blk.0.ssm_in.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors)
    config.architectures = ["Mamba2ForCausalLM"]
    return config


def mamba2_checkpoint_weights(config, weights: Iterable[tuple[str, Any]],
                              family: str) -> Iterator[tuple[str, Any]]:
    """HF-named checkpoint tensors of a `mamba2` file's tensors (module docstring).

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    for name, tensor in weights:
        layer, _, stem = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and stem in _MAMBA2_SUFFIXLESS:
            values = tensor.materialize().reshape(-1)
            if stem == "ssm_a":
                values = torch.log(-values)   # A = -exp(A_log)
            yield f"backbone.layers.{layer}.mixer.{_MAMBA2_SUFFIXLESS[stem]}", values
            continue
        hf_name = gguf_to_hf_name(name, MAMBA2_TENSOR_NAMES)
        if hf_name is None:
            raise ValueError(f"GGUF tensor {name} has no counterpart in {family}")
        if hf_name.endswith(".dt_bias.bias"):
            hf_name = hf_name[:-len(".bias")]
        elif hf_name.endswith(".conv1d.weight") and len(tensor.shape) == 2:
            tensor = tensor.materialize().unsqueeze(1)    # [conv_dim, L] -> [conv_dim, 1, L]
        elif hf_name.endswith(".mixer.norm.weight") and len(tensor.shape) == 2:
            tensor = tensor.materialize().reshape(-1)     # [groups, inner / groups] -> [inner]
        yield hf_name, tensor


# llama.cpp's tensor names -> HF checkpoint names for Qwen3-Next beyond the Qwen MoE ones (the
# router, shared expert and stacked experts); "{}" is the layer index.
QWEN3NEXT_TENSOR_NAMES = {
    **QWEN_MOE_TENSOR_NAMES,
    "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.attn_qkv": "model.layers.{}.linear_attn.in_proj_qkv",
    "blk.{}.attn_gate": "model.layers.{}.linear_attn.in_proj_z",
    "blk.{}.ssm_in": "model.layers.{}.linear_attn.in_proj_qkvz",   # the earlier converter's
    "blk.{}.ssm_ba": "model.layers.{}.linear_attn.in_proj_ba",
    "blk.{}.ssm_conv1d": "model.layers.{}.linear_attn.conv1d",
    "blk.{}.ssm_dt": "model.layers.{}.linear_attn.dt",             # .bias -> dt_bias
    "blk.{}.ssm_norm": "model.layers.{}.linear_attn.norm",
    "blk.{}.ssm_out": "model.layers.{}.linear_attn.out_proj",
}
# HF names of the norms the converter stores as 1 + w (Qwen3-Next's zero-centred RMSNorms).
_ONE_PLUS_W_NORMS = ("_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def qwen3next_hf_config(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]):
    """The HF `Qwen3NextConfig` of a `qwen3next` file, with `architectures` set (module
    docstring).

    Raises:
        ValueError: naming a missing key, no experts, or Gated DeltaNet sizes that do not
            divide (value heads by key heads, inner size by value heads).
    """
    import transformers

    k = GGUFKeys(metadata, "qwen3next")
    experts = k.integer("expert_count")
    if experts <= 0:
        raise ValueError(f"metadata key qwen3next.expert_count = {experts}: llama.cpp's "
                         f"qwen3next has a mixture of experts in every layer")
    moe_size = k.integer("expert_feed_forward_length")
    config = transformers.AutoConfig.for_model(
        "qwen3_next", **_gated_delta_net_fields(k, tensors),
        intermediate_size=k.integer("feed_forward_length", moe_size),
        num_experts=experts, num_experts_per_tok=k.integer("expert_used_count"),
        moe_intermediate_size=moe_size,
        shared_expert_intermediate_size=k.integer("expert_shared_feed_forward_length", 0),
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    config.architectures = ["Qwen3NextForCausalLM"]
    return config


def qwen35_hf_config(metadata: dict[str, Any], tensors: dict[str, tuple[int, ...]]):
    """The HF `Qwen3_5TextConfig` of a `qwen35` file (Qwen3.5's dense text model), with
    `architectures` set (module docstring). `rope.dimension_sections` (its multimodal RoPE's
    sections) is not read: for text the three position components are equal, and sectioned
    RoPE is plain RoPE.

    Raises:
        ValueError: naming a missing key, or Gated DeltaNet sizes that do not divide.
    """
    import transformers

    k = GGUFKeys(metadata, "qwen35")
    config = transformers.AutoConfig.for_model(
        "qwen3_5_text", **_gated_delta_net_fields(k, tensors),
        intermediate_size=k.integer("feed_forward_length"))
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def _gated_delta_net_fields(k: GGUFKeys, tensors: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The config fields `qwen3next` and `qwen35` files share: sizes, layer types (from the
    per-layer `attention.recurrent_layers` flags the converter writes, else from
    `full_attention_interval`), RoPE, the Gated DeltaNet's `ssm.*` sizes.

    Raises:
        ValueError: naming a missing or inconsistent key.
    """
    layers = k.integer("block_count") - k.integer("nextn_predict_layers", 0)
    hidden, heads = k.integer("embedding_length"), k.integer("attention.head_count")
    head_dim = k.integer("attention.key_length", hidden // heads)
    key_heads, value_heads = k.integer("ssm.group_count"), k.integer("ssm.time_step_rank")
    inner = k.integer("ssm.inner_size")
    if key_heads <= 0 or value_heads % key_heads or inner % value_heads:
        raise ValueError(f"metadata keys {k.arch}.ssm.group_count = {key_heads}, "
                         f"{k.arch}.ssm.time_step_rank = {value_heads}, {k.arch}.ssm.inner_size"
                         f" = {inner}: the value heads must be a multiple of the key heads and "
                         f"divide the inner size")
    rope_dim = k.integer("rope.dimension_count", head_dim)
    return dict(
        vocab_size=vocab_size(k, tensors), hidden_size=hidden, num_hidden_layers=layers,
        layer_types=_layer_types(k, layers),
        num_attention_heads=heads, num_key_value_heads=k.integer("attention.head_count_kv"),
        head_dim=head_dim, max_position_embeddings=k.integer("context_length"),
        rms_norm_eps=k.number("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default",
                         "rope_theta": k.number("rope.freq_base", 10000.0),
                         "partial_rotary_factor": rope_dim / head_dim},
        linear_conv_kernel_dim=k.integer("ssm.conv_kernel"),
        linear_key_head_dim=k.integer("ssm.state_size"), linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads, linear_value_head_dim=inner // value_heads,
        attention_bias=any(name.endswith(".attn_q.bias") for name in tensors),
        tie_word_embeddings="output.weight" not in tensors)


def _layer_types(k: GGUFKeys, layers: int) -> list[str]:
    """"linear_attention" / "full_attention" per layer: `attention.recurrent_layers` (one bool
    per block, MTP blocks included, as the converter writes it from the config's
    `layer_types`), else layer i is full attention when (i + 1) is a multiple of
    `full_attention_interval` (llama.cpp's default 4; files of earlier converters).

    Raises:
        ValueError: naming a flag array shorter than the layers or a non-positive interval.
    """
    recurrent = k.get("attention.recurrent_layers", None)
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < layers:
            raise ValueError(f"metadata key {k.arch}.attention.recurrent_layers = {recurrent!r}: "
                             f"not one flag for each of the {layers} layers")
        return ["linear_attention" if flag else "full_attention" for flag in recurrent[:layers]]
    interval = k.integer("full_attention_interval", 4)
    if interval <= 0:
        raise ValueError(f"metadata key {k.arch}.full_attention_interval = {interval} is not "
                         f"positive")
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)]


def qwen3next_checkpoint_weights(config, weights: Iterable[tuple[str, Any]],
                                 family: str) -> Iterator[tuple[str, Any]]:
    """HF-named checkpoint tensors of a `qwen3next` file's tensors (module docstring); the
    linear layers' and experts' tensors stay lazy GGUF tensors (quantized blocks kept). Blocks
    past `config.num_hidden_layers` (MTP layers) are skipped.

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    for name, tensor in weights:
        layer, _, stem = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and layer.isdigit() and int(layer) >= config.num_hidden_layers:
            continue
        if name.startswith("blk.") and stem == "ssm_a":   # A = -exp(A_log), [value heads]
            yield f"model.layers.{layer}.linear_attn.A_log", tensor.map(lambda a: torch.log(-a))
            continue
        for hf_name, tensor in qwen_moe_checkpoint_weights([(name, tensor)], family,
                                                           QWEN3NEXT_TENSOR_NAMES):
            yield _qwen3next_tensor(hf_name, tensor)


def _qwen3next_tensor(hf_name: str, tensor) -> tuple[str, Any]:
    """Undo the converter's value changes of one renamed tensor (module docstring)."""
    if hf_name.endswith(_ONE_PLUS_W_NORMS) or hf_name == "model.norm.weight":
        tensor = tensor.map(lambda w: w - 1.0)
    elif hf_name.endswith(".linear_attn.dt.bias"):
        hf_name = hf_name.replace(".dt.bias", ".dt_bias")
    elif hf_name.endswith(".conv1d.weight") and len(tensor.shape) == 2:
        tensor = tensor.materialize().unsqueeze(1)    # [conv_dim, K] -> [conv_dim, 1, K]
    elif hf_name.endswith(".shared_expert_gate.weight") and len(tensor.shape) == 1:
        tensor = tensor.materialize().unsqueeze(0)    # [hidden] -> [1, hidden]
    return hf_name, tensor


# llama.cpp's tensor names -> HF checkpoint names for Qwen3.5 (dense MLPs; the Gated DeltaNet's
# b and a projections as separate tensors); "{}" is the layer index.
QWEN35_TENSOR_NAMES = {
    **QWEN3NEXT_TENSOR_NAMES,
    "blk.{}.ssm_beta": "model.layers.{}.linear_attn.in_proj_b",
    "blk.{}.ssm_alpha": "model.layers.{}.linear_attn.in_proj_a",
}


def tiled_value_heads_order(num_k_heads: int, num_v_heads: int, rows_per_head: int
                            ) -> torch.Tensor:
    """Row order that takes llama.cpp's `qwen35` value heads back to HF's.

    HF groups the value heads by the key head they share ([k0: v0 v1 | k1: v0 v1], value head j
    reads key head j // (H_v / H_k)); convert_hf_to_gguf.py's `_LinearAttentionVReorderBase`
    tiles them ([k0 v0, k1 v0 | k0 v1, k1 v1]) for ggml's broadcast. `file[order]` is HF's
    order; `rows_per_head` rows per value head (its head size, or 1 for a per-head scalar).

    Returns:
        int64 [num_v_heads * rows_per_head].
    """
    per_k = num_v_heads // num_k_heads
    n = num_v_heads * rows_per_head
    return torch.arange(n).reshape(per_k, num_k_heads, rows_per_head).permute(1, 0, 2).reshape(n)


def qwen35_checkpoint_weights(config, weights: Iterable[tuple[str, Any]],
                              family: str) -> Iterator[tuple[str, Any]]:
    """HF-named checkpoint tensors of a `qwen35` file's tensors: `qwen3next`'s transforms
    undone (norms 1 + w, A = -exp(A_log), squeezed conv) and, when there are more value heads
    than key heads, the value heads taken back from the converter's tiled order
    (`tiled_value_heads_order`) in every tensor that has them: the value rows of `attn_qkv`
    and of the conv, `attn_gate`, `ssm_beta` / `ssm_alpha`, `ssm_a`, `ssm_dt.bias` (rows) and
    `ssm_out` (columns). Row orders stay lazy (quantized blocks kept); `ssm_out`'s column order
    keeps its blocks only when a value head spans whole blocks (`GGUFTensor.materialize_raw`).
    Blocks past `config.num_hidden_layers` (MTP layers) are skipped.

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    tiled = hk != hv
    qk_rows = 2 * hk * dk
    v_rows = torch.cat([torch.arange(qk_rows), qk_rows + tiled_value_heads_order(hk, hv, dv)])
    per_head = tiled_value_heads_order(hk, hv, 1)
    for name, tensor in weights:
        layer, _, stem = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and layer.isdigit() and int(layer) >= config.num_hidden_layers:
            continue
        if name.startswith("blk.") and stem == "ssm_a":   # A = -exp(A_log), [value heads]
            a_log = tensor.map(lambda a: torch.log(-a))
            yield (f"model.layers.{layer}.linear_attn.A_log",
                   a_log.map(lambda a: a[per_head]) if tiled else a_log)
            continue
        hf_name = gguf_to_hf_name(name, QWEN35_TENSOR_NAMES)
        if hf_name is None:
            raise ValueError(f"GGUF tensor {name} has no counterpart in {family}")
        hf_name, tensor = _qwen3next_tensor(hf_name, tensor)
        if tiled and ".linear_attn." in hf_name:
            tensor = _untile_value_heads(hf_name, tensor, v_rows,
                                         tiled_value_heads_order(hk, hv, dv), per_head)
        yield hf_name, tensor


def _untile_value_heads(hf_name: str, tensor, qkv_rows: torch.Tensor, v_rows: torch.Tensor,
                        per_head: torch.Tensor):
    """One Gated DeltaNet tensor of a `qwen35` file with its value heads in HF's order
    (`qwen35_checkpoint_weights`); other tensors unchanged."""
    module = hf_name.rsplit(".", 2)[-2]
    if module == "in_proj_qkv":
        return tensor.map(lambda w: w[qkv_rows])
    if module == "conv1d":   # [conv_dim, 1, K], materialized by _qwen3next_tensor
        return tensor[qkv_rows]
    if module == "in_proj_z":
        return tensor.map(lambda w: w[v_rows])
    if module in ("in_proj_b", "in_proj_a"):
        return tensor.map(lambda w: w[per_head])
    if hf_name.endswith(".dt_bias"):
        return tensor.map(lambda b: b[per_head])
    if module == "out_proj":
        return tensor.map(lambda w: w[:, v_rows])
    return tensor
