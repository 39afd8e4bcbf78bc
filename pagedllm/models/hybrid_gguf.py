"""llama.cpp's GGUF files of the hybrid families: `lfm2` (LFM2's short-conv / attention
layers) as `Lfm2ForCausalLM` checkpoints.

LFM2's config comes from transformers' own GGUF reader (it knows `lfm2`: the per-layer
`attention.head_count_kv` array gives the attention layers); the tensors are renamed here.
convert_hf_to_gguf.py's LFM2Model squeezes the conv weight [hidden, 1, L] to [hidden, L]
(unsqueezed back), stores the final norm (`model.embedding_norm`) as `token_embd_norm` and
permutes nothing (LFM2's RoPE is GPT-NeoX style in both layouts).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

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
