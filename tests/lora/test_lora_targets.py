"""`target_modules` are matched as PEFT matches them (issue #38): a list entry names a module
whose path equals it or ends with "." + it, a string is a regex over whole paths; targets the
model lacks are refused naming the model's own targets only (not another architecture's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.lora.peft import LoRAModelShapes, _check_targets, load_peft_adapter
from pagedllm.lora.request import LoRARequest
from tests.lora.adapters import make_peft_adapter

ATTN = {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8)}
SHARED = {"shared_expert.gate_proj": (8, 6), "shared_expert.up_proj": (8, 6),
          "shared_expert.down_proj": (6, 8), "shared_expert_gate": (8, 1)}
DENSE = {"gate_proj": (8, 12), "up_proj": (8, 12), "down_proj": (12, 8)}
# Qwen2-MoE-like: layer 0 dense, layer 1 sparse with a shared expert.
QWEN2_MOE = LoRAModelShapes(2, ATTN, (4, 8, 6), (DENSE, SHARED), frozenset({1}))
MIXTRAL = LoRAModelShapes(2, ATTN, (4, 8, 6), ({}, {}), frozenset({0, 1}))
F = Path("adapter")


@pytest.mark.parametrize("targets", [
    ["q_proj", "gate_proj"], ["self_attn.q_proj"], ["shared_expert.gate_proj"],
    ["mlp.shared_expert.gate_proj", "mlp.shared_expert_gate"], ["layers.1.self_attn.v_proj"],
    ["model.layers.0.mlp.down_proj"], ["experts.3.up_proj"], r".*\.(q|v)_proj",
    r"model\.layers\.1\.mlp\.shared_expert\..*", "all-linear", None])
def test_peft_matching_accepts(targets):
    _check_targets(F, targets, QWEN2_MOE)


@pytest.mark.parametrize("targets, bad", [
    (["mlp.q_proj"], "mlp.q_proj"), (["proj"], "proj"), (["o_proj", "ared_expert.gate_proj"],
                                                         "ared_expert.gate_proj"),
    (["model.layers.2.self_attn.q_proj"], "model.layers.2.self_attn.q_proj"),
    (["experts.4.up_proj"], "experts.4.up_proj")])
def test_peft_matching_refuses(targets, bad):
    with pytest.raises(ValueError, match=f"target modules \\['{bad}'\\] match no module"):
        _check_targets(F, targets, QWEN2_MOE)


def test_regex_matching_nothing_and_refused_modules():
    with pytest.raises(ValueError, match="regex '.*input_layernorm' matches no module"):
        _check_targets(F, ".*input_layernorm", QWEN2_MOE)
    with pytest.raises(ValueError, match="'self_attn.kv_b_proj' is not supported: MLA"):
        _check_targets(F, ["q_proj", "self_attn.kv_b_proj"], QWEN2_MOE)


def test_refusal_lists_only_the_models_own_targets():
    with pytest.raises(ValueError) as exc:
        _check_targets(F, ["shared_expert.gate_proj"], MIXTRAL)
    message = str(exc.value)
    for own in ("q_proj", "o_proj", "experts.{e}.w1"):
        assert own in message, message
    for other in ("kv_a_proj_with_mqa", "q_a_proj", "shared_expert_gate", "'gate_proj'"):
        assert other not in message, message


def test_dotted_targets_load_as_peft_wrote_them(tiny_checkpoints, tmp_path):
    """An adapter PEFT itself made with dotted target names loads, with the same modules as
    the same adapter under bare names."""
    base = tiny_checkpoints["llama"]
    shapes = LoRAModelShapes.from_hf_config(json.loads((base / "config.json").read_text()))
    dotted = make_peft_adapter(base, tmp_path / "dotted", 4,
                               ["self_attn.q_proj", "mlp.down_proj"], 8, False, seed=0)
    assert json.loads((dotted / "adapter_config.json").read_text())["target_modules"]
    bare = make_peft_adapter(base, tmp_path / "bare", 4, ["q_proj", "down_proj"], 8, False,
                             seed=0)
    got = load_peft_adapter(LoRARequest("d", 1, str(dotted)), shapes, 8)
    want = load_peft_adapter(LoRARequest("b", 2, str(bare)), shapes, 8)
    assert sorted(got.weights) == sorted(want.weights)
    assert {m for _, m in got.weights} == {"q_proj", "down_proj"}
