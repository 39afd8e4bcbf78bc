"""llama.cpp's GGUF files of the hybrid families: `lfm2` (LFM2's short-conv / attention
layers) as `Lfm2ForCausalLM` checkpoints, `mamba2` as `Mamba2ForCausalLM` checkpoints.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedllm.models.gguf_keys import GGUFKeys, vocab_size
from pagedllm.models.llama import gguf_to_hf_name

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
