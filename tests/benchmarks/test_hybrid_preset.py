"""The Qwen3-Next benchmark presets (`qwen3-next-200m`, `qwen3-next-tiny`, issue #37): the
layout (3 Gated DeltaNet layers to 1 attention layer, ~200M parameters) and `pagedllm bench
throughput --compare hf` on the tiny one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.benchmarks.presets import PRESETS, preset_path


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_qwen3_next_200m_has_the_issue_layout():
    import transformers

    preset = dict(PRESETS["qwen3-next-200m"])
    assert preset.pop("architecture") == "Qwen3NextForCausalLM"
    types = preset["layer_types"]
    assert types.count("linear_attention") == 3 * types.count("full_attention")
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**preset))
    assert 180e6 < sum(p.numel() for p in model.parameters()) < 220e6


@pytest.mark.slow
def test_qwen3_next_preset_runs_against_hf(tmp_path: Path):
    out = tmp_path / "tp.json"
    rc = _run(["bench", "throughput", "--preset", "qwen3-next-tiny", "--preset-dir",
               str(tmp_path / "presets"), "--dtype", "float32", "--kv-cache-memory-bytes",
               str(16 * 2**20), "--num-prompts", "3", "--input-len", "12", "--output-len", "6",
               "--compare", "hf", "--output-json", str(out)])
    assert rc == 0
    ours, hf = json.loads(out.read_text())["results"]
    assert ours["num_wrong_output_lens"] == 0 and hf["num_wrong_output_lens"] == 0
    assert hf["comparison"]["greedy_identical_requests"] == "3/3"
    assert Path(preset_path("qwen3-next-tiny", "float32", tmp_path / "presets")).is_dir()
