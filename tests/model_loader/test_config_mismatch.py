"""A config.json whose sizes disagree with the weights fails at load, naming the tensor.

The tensor-parallel loaders narrow each checkpoint tensor to a rank's slice; before the check in
`layers.linear.shard_of` (and its FusedMoE twin) a checkpoint dimension *larger* than the config
said passed that narrowing and loaded a part of the weight silently (a smaller
`qk_nope_head_dim`, `intermediate_size`, `head_dim`, ...), so the model ran on wrong weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig

from pagedllm.benchmarks.presets import preset_path
from pagedllm.model_loader.loader import load_model

# (preset, config field, value, the tensor the error names): each value is smaller than the
# size the preset's weights were written with, so only the sharded dimension disagrees.
CASES = [
    ("deepseek-v2-lite-tiny", "qk_nope_head_dim", 8, "self_attn.kv_b_proj.weight"),
    ("mixtral-tiny", "intermediate_size", 64, "mlp.experts.0.w1.weight"),
    ("mixtral-tiny", "num_key_value_heads", 1, "self_attn.k_proj.weight"),
    ("qwen3-next-tiny", "shared_expert_intermediate_size", 32,
     "mlp.shared_expert.down_proj.weight"),
    ("qwen3-next-tiny", "moe_intermediate_size", 16, "mlp.experts.0.down_proj.weight"),
]


@pytest.fixture(scope="module")
def presets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("presets")
    return {name: preset_path(name, "float32", root) for name in {c[0] for c in CASES}}


def _load(path) -> torch.nn.Module:
    return load_model(str(path), AutoConfig.from_pretrained(path), torch.float32,
                      torch.device("cpu"))


@pytest.mark.parametrize("preset, field, value, tensor", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_smaller_config_size_is_refused(presets, tmp_path, preset, field, value, tensor):
    folder = tmp_path / "ckpt"
    shutil.copytree(presets[preset], folder)
    config = json.loads((folder / "config.json").read_text())
    assert config[field] > value
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"checkpoint tensor \S*" + tensor.replace(".", r"\.")
                       + r": shape mismatch"):
        _load(folder)


def test_layers_past_num_hidden_layers_are_refused(presets, tmp_path):
    # DeepSeek's loader skips the layers past num_hidden_layers for its MTP drafter; only
    # num_nextn_predict_layers of them may be there.
    folder = tmp_path / "ckpt"
    shutil.copytree(presets["deepseek-v2-lite-tiny"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.\S+ is past the config's layers "
                                         r"\(num_hidden_layers 1, num_nextn_predict_layers 0\)"):
        _load(folder)
    config["num_nextn_predict_layers"] = 1      # layer 1 is then the (skipped) MTP layer
    (folder / "config.json").write_text(json.dumps(config))
    assert _load(folder) is not None


def test_unedited_presets_load(presets):
    for path in presets.values():
        assert _load(path) is not None
