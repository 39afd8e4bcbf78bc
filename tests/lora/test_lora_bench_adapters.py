"""`benchmarks.lora.write_random_adapters` on MoE models (Mixtral; Qwen2-MoE with a shared
expert, its gate and a dense layer; DeepSeek-V3 with MLA, shared experts and a dense first
layer): every projection of every layer and the routed experts get an adapter the engine reads
whole, and `peft` loads the same tensors (its names and nesting of the experts' 3-D
parameters: Mixtral, Qwen2-MoE; PEFT rewrites the DeepSeek family's MLP targets, see
tests/lora/test_lora_moe_shared.py)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pagedllm.benchmarks.lora import write_random_adapters
from pagedllm.lora.peft import LoRAModelShapes, load_peft_adapter
from tests.models.test_deepseek import build_checkpoint
from tests.models.test_moe import _build


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "v3"])
def test_random_adapters_cover_moe_models(variant, tmp_path, byte_level_tokenizer_dir):
    build = build_checkpoint if variant == "v3" else _build
    base = build(variant, tmp_path / "base", byte_level_tokenizer_dir)
    shapes = LoRAModelShapes.from_hf_config(json.loads((base / "config.json").read_text()))
    loras = write_random_adapters(str(base), tmp_path / "loras", 2, 4)
    assert [lora.lora_int_id for lora in loras] == [1, 2]
    for lora in loras:
        weights = load_peft_adapter(lora, shapes, 4).weights
        want = {(i, m) for i in range(shapes.num_layers) for m in shapes.layer_modules(i)}
        want |= {(i, f"experts.{p}") for i in range(shapes.num_layers) if shapes.is_sparse(i)
                 for p in ("gate_up", "down")}
        assert set(weights) == want
    if variant == "v3":
        return
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                      loras[0].lora_path)
    loaded = get_peft_model_state_dict(model)
    written = load_file(f"{loras[0].lora_path}/adapter_model.safetensors")
    assert loaded.keys() == written.keys()
    for name, tensor in written.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_random_adapters_refuse_an_architecture_without_lora(tmp_path, byte_level_tokenizer_dir):
    """Qwen3-Next has no LoRA support: refused naming it before any adapter file is written
    (the engine would refuse the adapters at start-up)."""
    base = _build("mixtral", tmp_path / "base", byte_level_tokenizer_dir)
    config = json.loads((base / "config.json").read_text())
    config["architectures"] = ["Qwen3NextForCausalLM"]
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM.*has no LoRA support"):
        write_random_adapters(str(base), tmp_path / "loras", 2, 4)
    assert not (tmp_path / "loras").exists()
