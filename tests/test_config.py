"""Engine config validation."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig, create_engine_config


def test_sliding_window_caps_context(tiny_checkpoints, tmp_path):
    path = tmp_path / "mistral"
    shutil.copytree(tiny_checkpoints["mistral"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    assert create_engine_config(str(path)).max_model_len == 64
    with pytest.raises(ValueError, match="sliding_window"):
        create_engine_config(str(path), max_model_len=128)


@pytest.mark.parametrize("make", [lambda: CacheConfig(block_size=12),
                                  lambda: CacheConfig(gpu_memory_utilization=0.0),
                                  lambda: SchedulerConfig(max_num_seqs=0)])
def test_invalid_values_name_the_field(make):
    with pytest.raises(ValueError) as info:
        make()
    assert any(name in str(info.value) for name in ("block_size", "gpu_memory_utilization",
                                                     "max_num_seqs"))


def test_max_model_len_beyond_model(tiny_checkpoints):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        create_engine_config(str(tiny_checkpoints["llama"]), max_model_len=10**6)
