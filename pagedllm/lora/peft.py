"""PEFT LoRA adapters on disk -> per-layer A/B tensors, checked against the base model.

PEFT's format (huggingface/peft): `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, ...) and `adapter_model.safetensors` with tensors named

    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_B.weight   [out_features, r]

and the layer computing `base(x) + scaling * (x A^T) B^T`, scaling = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). Modules q/k/v/o_proj and gate/up/down_proj are supported; the engine's
merged qkv_proj / gate_up_proj take them as slices (lora/layers.py). Everything else PEFT can
write (DoRA, modules_to_save, LoRA biases, embedding / LM head targets, per-module rank or
alpha patterns) is refused with an error naming it, never ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.lora.request import LoRARequest

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# The projections an adapter may target and the decoder block that holds them.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoRAModelShapes:
    """The base model's facts an adapter is checked against.

    Attributes:
        num_layers: decoder layers.
        features: module name -> (in_features, out_features) of that projection (unsharded).
    """

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LoRAModelShapes:
        """From a Llama-family config.json (as a dict)."""
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hidden // heads
        inter = hf["intermediate_size"]
        return cls(hf["num_hidden_layers"], {
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)})


@dataclass
class LoRAAdapter:
    """An adapter loaded on the host.

    Attributes:
        lora_request: the request that named it.
        rank: r of adapter_config.json.
        scaling: lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)), already folded into `weights`'
            B matrices.
        weights: (layer index, module name) -> (A [rank, in_features], B [out_features, rank]
            * scaling), float32 on the CPU; modules the adapter leaves out are absent.
    """

    lora_request: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"LoRA adapter {folder}: {CONFIG_NAME} not found")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"LoRA adapter {folder}: {CONFIG_NAME} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {folder}: {CONFIG_NAME} is not a JSON object")
    return config


def _check_config(folder: Path, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    """The adapter's (rank, scaling); ValueError naming any option this engine cannot apply."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {folder}: peft_type {peft_type!r} is not supported "
                         f"(only 'LORA')")
    unsupported = {
        "use_dora": config.get("use_dora"),
        "modules_to_save": config.get("modules_to_save"),
        "lora_bias": config.get("lora_bias"),
        "fan_in_fan_out": config.get("fan_in_fan_out"),
        "rank_pattern": config.get("rank_pattern"),
        "alpha_pattern": config.get("alpha_pattern"),
        "trainable_token_indices": config.get("trainable_token_indices"),
    }
    for option, value in unsupported.items():
        if value:
            raise ValueError(f"LoRA adapter {folder}: {option}={value!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {folder}: bias={config['bias']!r} is not supported "
                         f"(only 'none')")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {folder}: r must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {folder}: rank {rank} exceeds max_lora_rank "
                         f"({max_lora_rank})")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {folder}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(LORA_TARGET_MODULES))
        if unknown:
            raise ValueError(f"LoRA adapter {folder}: target modules {unknown} are not "
                             f"supported (the model's LoRA targets: {list(LORA_TARGET_MODULES)})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        found = "adapter_model.bin found: convert it to safetensors; " \
            if (folder / "adapter_model.bin").is_file() else ""
        raise ValueError(f"LoRA adapter {folder}: {found}{WEIGHTS_NAME} not found")
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors' errors are not one type
        raise ValueError(f"LoRA adapter {folder}: {WEIGHTS_NAME} cannot be read "
                         f"({type(e).__name__}: {e})") from e


def load_peft_adapter(lora_request: LoRARequest, shapes: LoRAModelShapes,
                      max_lora_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter at `lora_request.lora_path`.

    Returns:
        The adapter with float32 host tensors (B scaled).

    Raises:
        ValueError: naming the adapter folder and the problem: a missing or unreadable file, an
            unsupported PEFT option or target module, a rank over `max_lora_rank`, a tensor of
            a layer or module the model lacks, a shape that does not match the model, an A
            without its B, non-finite values.
    """
    folder = Path(lora_request.lora_path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: {folder} is not a folder")
    rank, scaling = _check_config(folder, _read_config(folder), max_lora_rank)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(folder).items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"LoRA adapter {folder}: tensor {name} targets a module this "
                             f"engine does not support (only {list(LORA_TARGET_MODULES)} of "
                             f"the decoder layers)")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes.features:
            raise ValueError(f"LoRA adapter {folder}: tensor {name} targets module {module!r}, "
                             f"which the model lacks")
        if layer >= shapes.num_layers:
            raise ValueError(f"LoRA adapter {folder}: tensor {name} targets layer {layer}; the "
                             f"model has {shapes.num_layers} layers")
        in_features, out_features = shapes.features[module]
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"LoRA adapter {folder}: tensor {name} has shape "
                             f"{list(tensor.shape)}, the model needs {list(expected)}")
        tensor = tensor.to(torch.float32)
        if not torch.isfinite(tensor).all():
            raise ValueError(f"LoRA adapter {folder}: tensor {name} has non-finite values")
        parts.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), ab in parts.items():
        if len(ab) != 2:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {folder}: layer {layer} {module} has no {missing}")
        weights[(layer, module)] = (ab["A"].contiguous(), (ab["B"] * scaling).contiguous())
    if not weights:
        raise ValueError(f"LoRA adapter {folder}: {WEIGHTS_NAME} holds no LoRA tensors")
    return LoRAAdapter(lora_request, rank, scaling, weights)
