"""llama.cpp's GGUF files of the Qwen MoE families as checkpoints of `Qwen3MoeForCausalLM`
(`qwen3moe`; configs from transformers' GGUF reader, completed in model_loader/gguf.py) and,
once checked against a file, `Qwen2MoeForCausalLM` (`qwen2moe`).

Names are Llama's plus the router (`ffn_gate_inp`), Qwen2-MoE's shared expert (`ffn_*_shexp`,
its gate `ffn_gate_inp_shexp`) and the stacked experts `ffn_{gate,up,down}_exps` [E, ...], handed
out one expert at a time (`GGUFTensor.expert`) so quantized experts stay in their blocks
(layers/quantization/gguf_moe.py). No Q/K permutation (Qwen's converter writes none).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from pagedllm.models.llama import GGUF_TENSOR_NAMES, gguf_to_hf_name

QWEN_MOE_TENSOR_NAMES = {
    **GGUF_TENSOR_NAMES,
    "blk.{}.ffn_gate_inp": "model.layers.{}.mlp.gate",
    "blk.{}.ffn_gate_inp_shexp": "model.layers.{}.mlp.shared_expert_gate",
    "blk.{}.ffn_gate_shexp": "model.layers.{}.mlp.shared_expert.gate_proj",
    "blk.{}.ffn_up_shexp": "model.layers.{}.mlp.shared_expert.up_proj",
    "blk.{}.ffn_down_shexp": "model.layers.{}.mlp.shared_expert.down_proj",
}
# Stacked experts: llama.cpp's tensor -> HF's per-expert projection.
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}
_EXPERTS = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight")


def expert_checkpoint_weights(name: str, tensor) -> list[tuple[str, Any]] | None:
    """The per-expert checkpoint tensors of llama.cpp's stacked experts: `name`
    `blk.{i}.ffn_{gate,up,down}_exps.weight` ([E, rows, cols]) -> E pairs
    (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, `tensor.expert(e)`: lazy,
    so quantized experts stay in their blocks); None for any other tensor."""
    experts = _EXPERTS.fullmatch(name)
    if experts is None:
        return None
    return [(f"model.layers.{experts[1]}.mlp.experts.{e}.{EXPERT_TENSORS[experts[2]]}.weight",
             tensor.expert(e)) for e in range(tensor.shape[0])]


def qwen_moe_checkpoint_weights(weights: Iterable[tuple[str, Any]], family: str,
                                names: dict[str, str] = QWEN_MOE_TENSOR_NAMES
                                ) -> Iterator[tuple[str, Any]]:
    """HF-named checkpoint tensors of a `qwen2moe` / `qwen3moe` file's tensors (`names`: the
    family's name map beside the stacked experts; `qwen3next` extends it).

    Raises:
        ValueError: naming a tensor with no counterpart in `family`.
    """
    for name, tensor in weights:
        experts = expert_checkpoint_weights(name, tensor)
        if experts is not None:
            yield from experts
            continue
        hf_name = gguf_to_hf_name(name, names)
        if hf_name is None:
            raise ValueError(f"GGUF tensor {name} has no counterpart in {family}")
        yield hf_name, tensor
