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

Mixture-of-experts experts (lora/moe.py) come in two layouts:
- transformers 5 holds a block's experts as 3-D parameters (`experts.gate_up_proj` [E, 2I, H],
  `experts.down_proj` [E, H, I]), which PEFT adapts through `target_parameters` (its
  `ParamWrapper`; two targeted parameters nest, so one of them sits under `.base_layer`):

      ...layers.{i}.mlp.experts[.base_layer].lora_A.weight   [E * r, in]   rows expert-major
      ...layers.{i}.mlp.experts[.base_layer].lora_B.weight   [out, r * E]  columns expert-minor

  expert e's delta is B.view(out, r, E)[:, :, e] @ A.view(E, r, in)[e] (peft's
  `ParamWrapper.get_delta_weight`). Which parameter a pair adapts is told by its shapes
  (gate_up: in H, out 2I; down: in I, out H; they cannot coincide);
- one module per expert, as PEFT wrote them for transformers 4 (`experts.{e}.w1|w2|w3` in
  Mixtral, `experts.{e}.gate_proj|up_proj|down_proj` elsewhere), stacked here over experts
  (an expert the adapter leaves out gets zeros).
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
# Expert tensors (module docstring): all experts of a 3-D parameter, or one expert's module.
_EXPERTS_PREFIX = r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts"
_FUSED_EXPERTS_TENSOR = re.compile(_EXPERTS_PREFIX + r"((?:\.base_layer)*)\.lora_([AB])\.weight")
_ONE_EXPERT_TENSOR = re.compile(_EXPERTS_PREFIX + r"\.(\d+)\.(\w+)\.lora_([AB])\.weight")
# Per-expert checkpoint module -> the expert projection ("gate" / "up" / "down").
EXPERT_MODULES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate",
                  "up_proj": "up", "down_proj": "down"}
# The 3-D expert parameters PEFT's `target_parameters` may name.
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class LoRAModelShapes:
    """The base model's facts an adapter is checked against.

    Attributes:
        num_layers: decoder layers.
        features: module name -> (in_features, out_features) of that projection (unsharded);
            a MoE model (every layer sparse) has no dense gate/up/down_proj.
        experts: (num_experts, hidden_size, expert intermediate size) of a MoE model's
            sparse blocks, or None.
    """

    num_layers: int
    features: dict[str, tuple[int, int]]
    experts: tuple[int, int, int] | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LoRAModelShapes:
        """From a Llama-family or MoE (Mixtral, OLMoE: a sparse block in every layer)
        config.json (as a dict)."""
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hidden // heads
        inter = hf["intermediate_size"]
        features = {
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
        num_experts = hf.get("num_local_experts") or hf.get("num_experts")
        if num_experts:
            return cls(hf["num_hidden_layers"], features, (
                num_experts, hidden, hf.get("moe_intermediate_size") or inter))
        features.update({"gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                         "down_proj": (inter, hidden)})
        return cls(hf["num_hidden_layers"], features)


@dataclass
class LoRAAdapter:
    """An adapter loaded on the host.

    Attributes:
        lora_request: the request that named it.
        rank: r of adapter_config.json.
        scaling: lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)), already folded into `weights`'
            B matrices.
        weights: (layer index, module name) -> (A [rank, in_features], B [out_features, rank]
            * scaling), float32 on the CPU; modules the adapter leaves out are absent. MoE
            experts are stacked over the E experts under the modules "experts.gate_up"
            (transformers 5's fused parameter: A [E, rank, H], B [E, 2I, rank]) or
            "experts.gate" / "experts.up" (per-expert modules: A [E, rank, H], B [E, I, rank]),
            and "experts.down" (A [E, rank, I], B [E, H, rank]).
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
        unknown = sorted(set(targets) - set(LORA_TARGET_MODULES) - set(EXPERT_MODULES))
        if unknown:
            raise ValueError(f"LoRA adapter {folder}: target modules {unknown} are not "
                             f"supported (the model's LoRA targets: {list(LORA_TARGET_MODULES)} "
                             f"and MoE experts' {list(EXPERT_MODULES)})")
    parameters = config.get("target_parameters") or []
    unknown = [p for p in (parameters if isinstance(parameters, list) else [parameters])
               if not isinstance(p, str) or not p.endswith(EXPERT_PARAMETERS)]
    if unknown:
        raise ValueError(f"LoRA adapter {folder}: target parameters {unknown} are not "
                         f"supported (only MoE experts' {list(EXPERT_PARAMETERS)})")
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
        layer, module, which, expected = _tensor_target(folder, name, shapes, rank)
        if expected is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"LoRA adapter {folder}: tensor {name} has shape "
                             f"{list(tensor.shape)}, the model needs {list(expected)}")
        tensor = tensor.to(torch.float32)
        if not torch.isfinite(tensor).all():
            raise ValueError(f"LoRA adapter {folder}: tensor {name} has non-finite values")
        parts.setdefault((layer, module), {})[which] = tensor
    pairs = {}
    for (layer, module), ab in parts.items():
        if len(ab) != 2:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {folder}: layer {layer} {module} has no {missing}")
        pairs[(layer, module)] = (ab["A"].contiguous(), (ab["B"] * scaling).contiguous())
    weights = {key: ab for key, ab in pairs.items() if not key[1].startswith("experts")}
    weights.update(_stack_experts(folder, pairs, shapes, rank))
    if not weights:
        raise ValueError(f"LoRA adapter {folder}: {WEIGHTS_NAME} holds no LoRA tensors")
    return LoRAAdapter(lora_request, rank, scaling, weights)


def _tensor_target(folder: Path, name: str, shapes: LoRAModelShapes, rank: int
                   ) -> tuple[int, str, str, tuple[int, int] | None]:
    """(layer, module key, "A" or "B", the shape the model needs) of adapter tensor `name`;
    the shape is None for a 3-D expert parameter's pair (checked by `_stack_experts`). Module
    keys: the projection, "experts.{e}.{gate|up|down}" (one expert), "experts[{d}]" (PEFT's
    parameter wrapper under d `.base_layer`s)."""
    fused = _FUSED_EXPERTS_TENSOR.fullmatch(name)
    one = None if fused else _ONE_EXPERT_TENSOR.fullmatch(name)
    match = fused or one or _TENSOR_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets a module this "
                         f"engine does not support (only {list(LORA_TARGET_MODULES)} of "
                         f"the decoder layers and MoE experts)")
    layer = int(match[1])
    if layer >= shapes.num_layers:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets layer {layer}; the "
                         f"model has {shapes.num_layers} layers")
    if (fused or one) and shapes.experts is None:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets MoE experts, which "
                         f"the model lacks")
    if fused:
        return layer, f"experts[{fused[2].count('.base_layer')}]", fused[3], None
    if one:
        num_experts, hidden, inter = shapes.experts
        expert, proj, which = int(one[2]), EXPERT_MODULES.get(one[3]), one[4]
        if proj is None:
            raise ValueError(f"LoRA adapter {folder}: tensor {name} targets expert module "
                             f"{one[3]!r}; supported: {list(EXPERT_MODULES)}")
        if expert >= num_experts:
            raise ValueError(f"LoRA adapter {folder}: tensor {name} targets expert {expert}; "
                             f"the model has {num_experts} experts per layer")
        in_features, out_features = (inter, hidden) if proj == "down" else (hidden, inter)
        return layer, f"experts.{expert}.{proj}", which, \
            (rank, in_features) if which == "A" else (out_features, rank)
    module, which = match[2], match[3]
    if module not in shapes.features:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets module {module!r}, "
                         f"which the model lacks")
    in_features, out_features = shapes.features[module]
    return layer, module, which, (rank, in_features) if which == "A" else (out_features, rank)


def _stack_experts(folder: Path, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                   shapes: LoRAModelShapes, rank: int
                   ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The expert pairs of `pairs` (`_tensor_target`'s keys, B scaled) as `LoRAAdapter.weights`'
    stacked "experts.gate_up" / "experts.gate" / "experts.up" / "experts.down" entries.

    Raises:
        ValueError: a 3-D parameter's pair whose shapes fit neither expert parameter, one
            projection given twice (both layouts, or two wrappers of one parameter), or
            transformers 5's gate_up beside per-expert gate or up modules in one layer.
    """
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    if shapes.experts is None:
        return out
    num_experts, hidden, inter = shapes.experts
    fused_shapes = {"gate_up": ((num_experts * rank, hidden), (2 * inter, rank * num_experts)),
                    "down": ((num_experts * rank, inter), (hidden, rank * num_experts))}
    per_expert: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def put(key: tuple[int, str], ab: tuple[torch.Tensor, torch.Tensor]) -> None:
        if key in out:
            raise ValueError(f"LoRA adapter {folder}: layer {key[0]} {key[1]} is given twice")
        out[key] = ab

    for (layer, module), (a, b) in pairs.items():
        if module.startswith("experts."):
            _, expert, proj = module.split(".")
            per_expert.setdefault((layer, proj), {})[int(expert)] = (a, b)
        elif module.startswith("experts["):
            proj = next((p for p, (sa, sb) in fused_shapes.items()
                         if tuple(a.shape) == sa and tuple(b.shape) == sb), None)
            if proj is None:
                raise ValueError(
                    f"LoRA adapter {folder}: layer {layer} experts' lora_A {list(a.shape)} and "
                    f"lora_B {list(b.shape)} fit neither experts.gate_up_proj (needs "
                    f"{[list(s) for s in fused_shapes['gate_up']]}) nor experts.down_proj "
                    f"(needs {[list(s) for s in fused_shapes['down']]})")
            # peft's ParamWrapper: A rows expert-major, B columns expert-minor.
            put((layer, f"experts.{proj}"),
                (a.view(num_experts, rank, a.shape[1]).contiguous(),
                 b.view(b.shape[0], rank, num_experts).permute(2, 0, 1).contiguous()))
    for (layer, proj), experts in per_expert.items():
        a0, b0 = next(iter(experts.values()))
        stacked_a = a0.new_zeros(num_experts, *a0.shape)
        stacked_b = b0.new_zeros(num_experts, *b0.shape)
        for expert, (a, b) in experts.items():
            stacked_a[expert], stacked_b[expert] = a, b
        put((layer, f"experts.{proj}"), (stacked_a, stacked_b))
    for layer, module in list(out):
        if module == "experts.gate_up" and ({(layer, "experts.gate"), (layer, "experts.up")}
                                            & out.keys()):
            raise ValueError(f"LoRA adapter {folder}: layer {layer} adapts the experts' fused "
                             f"gate_up_proj and per-expert gate or up projections")
    return out
