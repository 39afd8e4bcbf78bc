"""PEFT LoRA adapters on disk -> per-layer A/B tensors, checked against the base model.

PEFT's format (huggingface/peft): `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, ...) and `adapter_model.safetensors` with tensors named

    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_B.weight   [out_features, r]

and the layer computing `base(x) + scaling * (x A^T) B^T`, scaling = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)), per module by `rank_pattern` / `alpha_pattern` where they match it.
Modules q/k/v/o_proj and gate/up/down_proj are supported (a MoE block's shared expert's as
`mlp.shared_expert[s].{gate|up|down}_proj`, Qwen2-MoE's `mlp.shared_expert_gate`), and
DeepSeek MLA's q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa / o_proj; the engine's merged
qkv_proj / gate_up_proj take them as slices (lora/layers.py). MLA's kv_b_proj and everything
else PEFT can write (DoRA, modules_to_save, LoRA biases) is refused with an error naming it,
never ignored.

The token embedding and the LM head (lora/vocab.py) are stored under the layer index
`VOCAB_LAYER`, in the same (A [r, in], B [out, r]) convention (the embedding's "in" is the
vocabulary, one-hot):

    base_model.model.model.embed_tokens.lora_embedding_A   [r, vocab_size]
    base_model.model.model.embed_tokens.lora_embedding_B   [hidden_size, r]
    base_model.model.lm_head.lora_A.weight                 [r, hidden_size]
    base_model.model.lm_head.lora_B.weight                 [vocab_size, r]

(peft's `lora.Embedding` adds scaling * B A[:, token] to a token's row; its `lora.Linear`
on lm_head adds scaling * (h A^T) B^T to the logits). Under tensor parallelism every rank
holds them whole (lora/vocab.py).

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
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pagedllm.lora.request import LoRARequest

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# The projections an adapter may target and the decoder block that holds them: Llama-family
# attention and MLP, DeepSeek's MLA projections, and a Qwen2-MoE shared expert's gate.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                       "shared_expert_gate", "embed_tokens", "lm_head")
# The attention's projections (under "self_attn"; the rest sit under "mlp").
_ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                                "kv_a_proj_with_mqa", "kv_b_proj"})
# The layer index under which `LoRAAdapter.weights` holds the embedding and LM head pairs.
VOCAB_LAYER = -1
# Modules PEFT can target that the engine refuses, with the reason.
REFUSED_MODULES = {
    "kv_b_proj": "MLA never runs kv_b_proj as a linear layer: its weight is read per head "
                 "(W_UK absorbed into the query, W_UV into the output, or both expanding the "
                 "cached latents), so an adapter on it would need those per-head matrices "
                 "re-made per adapter; target q_proj / q_a_proj / q_b_proj / "
                 "kv_a_proj_with_mqa / o_proj instead"}
_VOCAB_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?:model\.(embed_tokens)\.lora_embedding_([AB])"
    r"|(lm_head)\.lora_([AB])\.weight)")
# The base weights PEFT saves beside embedding adapters (`save_embedding_layers`, on by default
# when an embedding is targeted): frozen in LoRA training, so a copy of the base model's.
_VOCAB_BASE_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\.base_layer\.weight")
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"((?:shared_experts?\.)?\w+)\.lora_([AB])\.weight")
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
        features: module name -> (in_features, out_features) of the projections every layer
            has (unsharded): the attention's, and the dense MLP's in a dense model.
        experts: (num_experts, hidden_size, expert intermediate size) of a MoE model's
            sparse blocks, or None.
        layer_features: per layer, the modules only some layers have: a dense MLP's
            gate/up/down_proj on a MoE model's dense layers, a shared expert's
            ("shared_expert.gate_proj", "shared_experts.down_proj", ...) and
            "shared_expert_gate" on its sparse layers. Empty for a dense model.
        sparse_layers: the layers with routed experts (all of them when `experts` is set and
            this is None).
        vocab: (vocab_size, hidden_size), for the embedding and LM head targets (None: the
            model takes none).
    """

    num_layers: int
    features: dict[str, tuple[int, int]]
    experts: tuple[int, int, int] | None = None
    layer_features: tuple[dict[str, tuple[int, int]], ...] = ()
    sparse_layers: frozenset[int] | None = None
    vocab: tuple[int, int] | None = None

    def module_features(self, layer: int, module: str) -> tuple[int, int] | None:
        """(in_features, out_features) of `module` in layer `layer`, None if it lacks it."""
        found = self.features.get(module)
        if found is None and self.layer_features:
            found = self.layer_features[layer].get(module)
        return found

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has routed experts."""
        return self.experts is not None and (self.sparse_layers is None
                                             or layer in self.sparse_layers)

    def layer_modules(self, layer: int) -> dict[str, tuple[int, int]]:
        """Every projection of layer `layer` an adapter may target, with its features."""
        return {**self.features, **(self.layer_features[layer] if self.layer_features else {})}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LoRAModelShapes:
        """From a supported architecture's config.json (as a dict): Llama-family attention or
        DeepSeek's MLA (`kv_lora_rank`); a dense MLP, or MoE blocks (Mixtral, OLMoE,
        Qwen2-MoE / Qwen3-MoE, DeepSeek-V2 / V3, GLM-4 MoE) with their dense layers and
        shared experts placed by the model files' own rules; the vocabulary size for the
        embedding and LM head targets."""
        shapes = cls._from_hf_config(hf)
        return replace(shapes, vocab=(hf["vocab_size"], hf["hidden_size"]))

    @classmethod
    def _from_hf_config(cls, hf: dict[str, Any]) -> LoRAModelShapes:
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        inter = hf["intermediate_size"]
        num_layers = hf["num_hidden_layers"]
        if hf.get("kv_lora_rank"):
            features = _mla_features(hf)
        else:
            kv_heads = hf.get("num_key_value_heads") or heads
            head_dim = hf.get("head_dim") or hidden // heads
            features = {
                "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
                "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
        dense_mlp = _mlp_features(hidden, inter)
        num_experts = (hf.get("num_local_experts") or hf.get("num_experts")
                       or hf.get("n_routed_experts"))
        if not num_experts:
            return cls(num_layers, {**features, **dense_mlp})
        moe_inter = hf.get("moe_intermediate_size") or inter
        sparse, shared = _moe_layout(hf, num_layers, moe_inter)
        layer_features = tuple(
            ({f"{prefix}.{m}": f for prefix, size in shared.items() if size
              for m, f in _mlp_features(hidden, size).items()}
             | ({"shared_expert_gate": (hidden, 1)} if shared.get("shared_expert") else {}))
            if i in sparse else dict(dense_mlp) for i in range(num_layers))
        return cls(num_layers, features, (num_experts, hidden, moe_inter), layer_features,
                   frozenset(sparse))


def _mlp_features(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _mla_features(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """DeepSeek MLA's projections an adapter may target (kv_b_proj: REFUSED_MODULES)."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    qk_head = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    features = {"kv_a_proj_with_mqa": (hidden, hf["kv_lora_rank"] + hf["qk_rope_head_dim"]),
                "o_proj": (heads * hf["v_head_dim"], hidden)}
    q_rank = hf.get("q_lora_rank")
    if q_rank:
        features.update(q_a_proj=(hidden, q_rank), q_b_proj=(q_rank, heads * qk_head))
    else:
        features["q_proj"] = (hidden, heads * qk_head)
    return features


def _moe_layout(hf: dict[str, Any], num_layers: int, moe_inter: int
                ) -> tuple[set[int], dict[str, int]]:
    """(the sparse layers, shared expert module prefix -> its intermediate size) of a MoE
    config, by the rules of the model files (models/qwen_moe.py, models/deepseek_v2.py)."""
    from types import SimpleNamespace

    config = SimpleNamespace(**hf)
    if hf.get("n_routed_experts"):       # DeepSeek-V2 / V3, GLM-4 MoE
        from pagedllm.models.deepseek_v2 import DeepseekV2ForCausalLM
        sparse = {i for i in range(num_layers)
                  if not DeepseekV2ForCausalLM.is_dense_layer(config, i)}
        return sparse, {"shared_experts": (hf.get("n_shared_experts") or 0) * moe_inter}
    if hf.get("num_local_experts"):      # Mixtral
        return set(range(num_layers)), {}
    from pagedllm.models.qwen_moe import is_sparse_layer   # Qwen2/3-MoE, OLMoE
    sparse = {i for i in range(num_layers) if is_sparse_layer(config, i)}
    qwen2_moe = (hf.get("model_type") == "qwen2_moe"
                 or "Qwen2MoeForCausalLM" in (hf.get("architectures") or ()))
    shared = hf.get("shared_expert_intermediate_size") if qwen2_moe else 0
    return sparse, {"shared_expert": shared or 0}


@dataclass
class LoRAAdapter:
    """An adapter loaded on the host.

    Attributes:
        lora_request: the request that named it.
        rank: the largest rank of its modules (r of adapter_config.json, or more where
            `rank_pattern` says so).
        scaling: lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)), already folded into `weights`'
            B matrices (each module's own, where rank_pattern / alpha_pattern match it).
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


@dataclass(frozen=True)
class _Ranks:
    """An adapter's rank and lora_alpha, with PEFT's per-module `rank_pattern` /
    `alpha_pattern` (regex keys matched against the module path as `peft.utils.other.
    get_pattern_key` does: the first key K with `(.*\\.)?(K)$` matching the path)."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    @staticmethod
    def _lookup(pattern: dict, path: str, default):
        for key, value in pattern.items():
            if re.match(rf"(.*\.)?({key})$", path):
                return value
        return default

    def rank(self, path: str) -> int:
        """The rank of the module at `path` (e.g. "model.layers.1.mlp.experts.gate_up_proj")."""
        return self._lookup(self.rank_pattern, path, self.r)

    def scaling(self, path: str) -> float:
        """lora_alpha / r of the module at `path` (rsLoRA: lora_alpha / sqrt(r))."""
        rank = self.rank(path)
        alpha = self._lookup(self.alpha_pattern, path, self.alpha)
        return float(alpha / math.sqrt(rank) if self.rslora else alpha / rank)


def _check_patterns(folder: Path, config: dict[str, Any]) -> tuple[dict, dict]:
    """`rank_pattern` and `alpha_pattern`, checked (regex keys, positive numbers)."""
    patterns = []
    for option in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(option) or {}
        if not isinstance(pattern, dict):
            raise ValueError(f"LoRA adapter {folder}: {option} must be a JSON object")
        for key, value in pattern.items():
            try:
                re.compile(key)
            except re.error as e:
                raise ValueError(f"LoRA adapter {folder}: {option} key {key!r} is not a "
                                 f"regular expression ({e})") from None
            bad = (isinstance(value, bool) or not isinstance(value, (int, float))
                   or not math.isfinite(value) or value <= 0
                   or (option == "rank_pattern" and not isinstance(value, int)))
            if bad:
                raise ValueError(f"LoRA adapter {folder}: {option}[{key!r}] must be a "
                                 f"positive {'integer' if option == 'rank_pattern' else 'number'}"
                                 f", got {value!r}")
        patterns.append(dict(pattern))
    return patterns[0], patterns[1]


def _check_config(folder: Path, config: dict[str, Any], max_lora_rank: int,
                  shapes: LoRAModelShapes) -> _Ranks:
    """The adapter's ranks and alphas; ValueError naming any option this engine cannot
    apply (or a target the model lacks)."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {folder}: peft_type {peft_type!r} is not supported "
                         f"(only 'LORA')")
    unsupported = {
        "use_dora": config.get("use_dora"),
        "modules_to_save": config.get("modules_to_save"),
        "lora_bias": config.get("lora_bias"),
        "fan_in_fan_out": config.get("fan_in_fan_out"),
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
    _check_targets(folder, config.get("target_modules"), shapes)
    parameters = config.get("target_parameters") or []
    # (PEFT's transformers-5 conversion also writes the bare names "gate_up_proj", "down_proj")
    unknown = [p for p in (parameters if isinstance(parameters, list) else [parameters])
               if not isinstance(p, str) or not (p.endswith(EXPERT_PARAMETERS) or p in (
                   "gate_up_proj", "down_proj"))]
    if unknown:
        raise ValueError(f"LoRA adapter {folder}: target parameters {unknown} are not "
                         f"supported (only MoE experts' {list(EXPERT_PARAMETERS)})")
    rank_pattern, alpha_pattern = _check_patterns(folder, config)
    return _Ranks(rank, float(alpha), bool(config.get("use_rslora")), rank_pattern, alpha_pattern)


def _model_module_paths(shapes: LoRAModelShapes) -> Iterator[str]:
    """The module paths ("model.layers.3.self_attn.q_proj") of every projection of the model
    an adapter may target: the attention's and MLP's first, the embedding and LM head, then
    each MoE expert's, under both expert block names ("mlp", Mixtral's "block_sparse_moe")
    and module names."""
    for layer in range(shapes.num_layers):
        for module in shapes.layer_modules(layer):
            block = "self_attn" if module in _ATTENTION_MODULES else "mlp"
            yield f"model.layers.{layer}.{block}.{module}"
    yield "model.embed_tokens"
    yield "lm_head"
    if shapes.experts is None:
        return
    for layer in range(shapes.num_layers):
        if shapes.is_sparse(layer):
            for block in ("mlp", "block_sparse_moe"):
                for expert in range(shapes.experts[0]):
                    for module in EXPERT_MODULES:
                        yield f"model.layers.{layer}.{block}.experts.{expert}.{module}"


def _check_targets(folder: Path, targets: Any, shapes: LoRAModelShapes) -> None:
    """Check `target_modules` against the model as PEFT matches it
    (peft.tuners.tuners_utils.check_target_module_exists): a list entry names a module whose
    path equals it or ends with "." + it (so "q_proj", "self_attn.q_proj" and
    "mlp.shared_expert.gate_proj" all work); a string is a regex the whole path must match.

    Raises:
        ValueError: a refused module (REFUSED_MODULES), list entries matching none of the
            model's targetable modules (naming them and the model's own targets), or a regex
            that matches none.
    """
    if targets is None or (isinstance(targets, str) and targets == "all-linear"):
        return
    own = list(dict.fromkeys(m for layer in range(shapes.num_layers)
                             for m in shapes.layer_modules(layer)))
    own += ["embed_tokens", "lm_head"]
    if shapes.experts is not None:
        own += [f"experts.{{e}}.{m}" for m in EXPERT_MODULES]
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise ValueError(f"LoRA adapter {folder}: target_modules {targets!r} is not a "
                             f"valid regex: {e}") from e
        if not any(pattern.fullmatch(path) for path in _model_module_paths(shapes)):
            raise ValueError(f"LoRA adapter {folder}: target_modules regex {targets!r} matches "
                             f"no module of the model this engine can adapt (the model's LoRA "
                             f"targets: {own})")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"LoRA adapter {folder}: target_modules must be a list of module "
                         f"names or a regex string, got {targets!r}")
    for target in targets:
        module = target.rsplit(".", 1)[-1]
        if module in REFUSED_MODULES:
            raise ValueError(f"LoRA adapter {folder}: target module {target!r} is not "
                             f"supported: {REFUSED_MODULES[module]}")
    unknown = [t for t in targets if not any(path == t or path.endswith("." + t)
                                             for path in _model_module_paths(shapes))]
    if unknown:
        raise ValueError(f"LoRA adapter {folder}: target modules {sorted(unknown)} match no "
                         f"module of the model this engine can adapt (PEFT matches a target "
                         f"as a module's whole path or its end after a dot; the model's LoRA "
                         f"targets: {own})")


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
    ranks = _check_config(folder, _read_config(folder), max_lora_rank, shapes)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    paths: dict[tuple[int, str], str] = {}
    for name, tensor in _read_tensors(folder).items():
        if _VOCAB_BASE_TENSOR.fullmatch(name) and shapes.vocab is not None:
            _check_vocab_base(folder, name, tensor, shapes)
            continue
        layer, module, which, expected = _tensor_target(folder, name, shapes, ranks)
        paths[(layer, module)] = _module_path(name)
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
        pairs[(layer, module)] = (ab["A"].contiguous(), ab["B"])
    weights = {key: (a, (b * ranks.scaling(paths[key])).contiguous())
               for key, (a, b) in pairs.items() if not key[1].startswith("experts")}
    weights.update(_stack_experts(folder, pairs, paths, shapes, ranks))
    if not weights:
        raise ValueError(f"LoRA adapter {folder}: {WEIGHTS_NAME} holds no LoRA tensors")
    # rank_pattern may give some modules more rank than r: the slots must hold the largest.
    rank = max(a.shape[-2] for a, _ in weights.values())
    if rank > max_lora_rank:
        key = next(k for k, (a, _) in weights.items() if a.shape[-2] == rank)
        raise ValueError(f"LoRA adapter {folder}: layer {key[0]} {key[1]} has rank {rank} "
                         f"(rank_pattern), which exceeds max_lora_rank ({max_lora_rank})")
    default = ranks.alpha / (math.sqrt(ranks.r) if ranks.rslora else ranks.r)
    return LoRAAdapter(lora_request, rank, float(default), weights)


def _module_path(name: str) -> str:
    """The module path PEFT matches rank/alpha patterns against, of adapter tensor `name`
    ("...layers.1.mlp.experts.base_layer.lora_A.weight" -> "model.layers.1.mlp.experts")."""
    return re.sub(r"(\.base_layer)*\.lora_(?:embedding_)?[AB](?:\.weight)?$", "",
                  name.removeprefix("base_model.model."))


def _tensor_target(folder: Path, name: str, shapes: LoRAModelShapes, ranks: _Ranks
                   ) -> tuple[int, str, str, tuple[int, int] | None]:
    """(layer, module key, "A" or "B", the shape the model needs) of adapter tensor `name`;
    the shape is None for a 3-D expert parameter's pair (checked by `_stack_experts`). Module
    keys: the projection, "experts.{e}.{gate|up|down}" (one expert), "experts[{d}]" (PEFT's
    parameter wrapper under d `.base_layer`s)."""
    vocab = _VOCAB_TENSOR.fullmatch(name)
    if vocab:
        return _vocab_target(folder, name, vocab, shapes, ranks)
    fused = _FUSED_EXPERTS_TENSOR.fullmatch(name)
    one = None if fused else _ONE_EXPERT_TENSOR.fullmatch(name)
    match = fused or one or _TENSOR_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets a module this "
                         f"engine does not support (only {list(LORA_TARGET_MODULES)} of "
                         f"the decoder layers, the embedding, the LM head and MoE experts)")
    layer = int(match[1])
    if layer >= shapes.num_layers:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets layer {layer}; the "
                         f"model has {shapes.num_layers} layers")
    if (fused or one) and shapes.experts is None:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets MoE experts, which "
                         f"the model lacks")
    if (fused or one) and not shapes.is_sparse(layer):
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets MoE experts, which "
                         f"layer {layer} lacks (a dense layer)")
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
        rank = ranks.rank(_module_path(name))
        return layer, f"experts.{expert}.{proj}", which, \
            (rank, in_features) if which == "A" else (out_features, rank)
    module, which = match[2], match[3]
    if module in REFUSED_MODULES:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets {module}, which is not "
                         f"supported: {REFUSED_MODULES[module]}")
    features = shapes.module_features(layer, module)
    if features is None:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets module {module!r}, "
                         f"which the model lacks" + (f" in layer {layer}" if any(
                             module in f for f in shapes.layer_features) else ""))
    in_features, out_features = features
    rank = ranks.rank(_module_path(name))
    return layer, module, which, (rank, in_features) if which == "A" else (out_features, rank)


def _check_vocab_base(folder: Path, name: str, tensor: torch.Tensor,
                      shapes: LoRAModelShapes) -> None:
    """Accept PEFT's saved copy of the embedding or LM head base weight (`_VOCAB_BASE_TENSOR`),
    which is not applied: LoRA training leaves the base weight frozen, so it is the model's.
    A different shape means a resized vocabulary, which the engine does not take."""
    vocab_size, hidden = shapes.vocab
    if tuple(tensor.shape) != (vocab_size, hidden):
        raise ValueError(f"LoRA adapter {folder}: tensor {name} has shape {list(tensor.shape)}"
                         f", the model's is {[vocab_size, hidden]} (adapters with a resized "
                         f"vocabulary are not supported)")


def _vocab_target(folder: Path, name: str, match: re.Match, shapes: LoRAModelShapes,
                  ranks: _Ranks) -> tuple[int, str, str, tuple[int, int]]:
    """`_tensor_target` for an embedding or LM head tensor (module docstring's names)."""
    module, which = (match[1], match[2]) if match[1] else (match[3], match[4])
    if shapes.vocab is None:
        raise ValueError(f"LoRA adapter {folder}: tensor {name} targets {module}, which this "
                         f"model takes no adapter on")
    vocab_size, hidden = shapes.vocab
    in_features, out_features = (vocab_size, hidden) if module == "embed_tokens" \
        else (hidden, vocab_size)
    rank = ranks.rank(_module_path(name))
    return VOCAB_LAYER, module, which, \
        (rank, in_features) if which == "A" else (out_features, rank)


def _stack_experts(folder: Path, pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                   paths: dict[tuple[int, str], str], shapes: LoRAModelShapes, ranks: _Ranks
                   ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The expert pairs of `pairs` (`_tensor_target`'s keys, B not scaled; `paths`: their
    module paths) as `LoRAAdapter.weights`' stacked "experts.gate_up" / "experts.gate" /
    "experts.up" / "experts.down" entries, B scaled (each projection's rank and scaling by
    rank_pattern / alpha_pattern: PEFT's transformers-5 conversion gives a fused gate_up twice
    the rank and alpha). Experts of different ranks are zero-padded to the largest.

    Raises:
        ValueError: a 3-D parameter's pair whose shapes fit neither expert parameter, one
            projection given twice (both layouts, or two wrappers of one parameter), or
            transformers 5's gate_up beside per-expert gate or up modules in one layer.
    """
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    if shapes.experts is None:
        return out
    num_experts, hidden, inter = shapes.experts
    per_expert: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def put(key: tuple[int, str], ab: tuple[torch.Tensor, torch.Tensor]) -> None:
        if key in out:
            raise ValueError(f"LoRA adapter {folder}: layer {key[0]} {key[1]} is given twice")
        out[key] = ab

    for (layer, module), (a, b) in pairs.items():
        if module.startswith("experts."):
            _, expert, proj = module.split(".")
            per_expert.setdefault((layer, proj), {})[int(expert)] = (
                a, b * ranks.scaling(paths[(layer, module)]))
        elif module.startswith("experts["):
            rank = {p: ranks.rank(f"{paths[(layer, module)]}.{p}_proj")
                    for p in ("gate_up", "down")}
            fused_shapes = {
                "gate_up": ((num_experts * rank["gate_up"], hidden),
                            (2 * inter, rank["gate_up"] * num_experts)),
                "down": ((num_experts * rank["down"], inter), (hidden, rank["down"] * num_experts))}
            proj = next((p for p, (sa, sb) in fused_shapes.items()
                         if tuple(a.shape) == sa and tuple(b.shape) == sb), None)
            if proj is None:
                raise ValueError(
                    f"LoRA adapter {folder}: layer {layer} experts' lora_A {list(a.shape)} and "
                    f"lora_B {list(b.shape)} fit neither experts.gate_up_proj (needs "
                    f"{[list(s) for s in fused_shapes['gate_up']]}) nor experts.down_proj "
                    f"(needs {[list(s) for s in fused_shapes['down']]})")
            # peft's ParamWrapper: A rows expert-major, B columns expert-minor.
            scaling = ranks.scaling(f"{paths[(layer, module)]}.{proj}_proj")
            put((layer, f"experts.{proj}"),
                (a.view(num_experts, rank[proj], a.shape[1]).contiguous(),
                 (b * scaling).view(b.shape[0], rank[proj], num_experts).permute(2, 0, 1)
                 .contiguous()))
    for (layer, proj), experts in per_expert.items():
        top = max(a.shape[0] for a, _ in experts.values())
        a0, b0 = next(iter(experts.values()))
        stacked_a = a0.new_zeros(num_experts, top, a0.shape[1])
        stacked_b = b0.new_zeros(num_experts, b0.shape[0], top)
        for expert, (a, b) in experts.items():
            stacked_a[expert, :a.shape[0]], stacked_b[expert, :, :b.shape[1]] = a, b
        put((layer, f"experts.{proj}"), (stacked_a, stacked_b))
    for layer, module in list(out):
        if module == "experts.gate_up" and ({(layer, "experts.gate"), (layer, "experts.up")}
                                            & out.keys()):
            raise ValueError(f"LoRA adapter {folder}: layer {layer} adapts the experts' fused "
                             f"gate_up_proj and per-expert gate or up projections")
    return out
