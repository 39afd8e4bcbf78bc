"""The DeepSeek-V2-Lite benchmark presets (issue #36): the 200M shape (counted on the meta
device, nothing built) and `pagedllm bench throughput` on the tiny one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import transformers

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.benchmarks.presets import _COMMON_CONFIG, PRESETS


def test_deepseek_200m_has_the_issue_shape():
    """V2-Lite's shape: MLA without q_lora, 64 routed + 2 shared experts, top-6; ~200M
    parameters."""
    kwargs = dict(PRESETS["deepseek-v2-lite-200m"])
    assert kwargs.pop("architecture") == "DeepseekV2ForCausalLM"
    config = transformers.DeepseekV2Config(**{**_COMMON_CONFIG, **kwargs})
    assert config.q_lora_rank is None
    assert (config.n_routed_experts, config.n_shared_experts, config.num_experts_per_tok) == (
        64, 2, 6)
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(config)
    assert 190e6 < sum(p.numel() for p in model.parameters()) < 210e6


@pytest.mark.slow
def test_deepseek_tiny_preset_runs_in_bench(tmp_path: Path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "tp.json"
    args = parser.parse_args(["bench", "throughput", "--preset", "deepseek-v2-lite-tiny",
                              "--preset-dir", str(tmp_path / "presets"), "--dtype", "float32",
                              "--kv-cache-memory-bytes", str(16 * 2**20), "--num-prompts", "3",
                              "--input-len", "12", "--output-len", "6", "--output-json",
                              str(out)])
    assert args.func(args) == 0
    assert json.loads(out.read_text())
