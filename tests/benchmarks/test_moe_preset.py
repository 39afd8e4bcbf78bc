"""The Mixtral benchmark presets (`mixtral-512`, `mixtral-tiny`): `build_checkpoint` with an
architecture, and `pagedllm bench throughput --compare hf` on the tiny one (seconds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.benchmarks.presets import PRESETS, build_checkpoint, preset_path


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_mixtral_512_has_the_issue_shape():
    preset = PRESETS["mixtral-512"]
    assert preset["architecture"] == "MixtralForCausalLM"
    assert (preset["hidden_size"], preset["num_local_experts"], preset["num_experts_per_tok"],
            preset["num_hidden_layers"]) == (512, 8, 2, 8)


def test_mixtral_preset_loads_in_transformers_and_runs_against_hf(tmp_path: Path):
    from transformers import AutoConfig

    path = preset_path("mixtral-tiny", "float32", tmp_path / "presets")
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["MixtralForCausalLM"] and config.num_local_experts == 4
    out = tmp_path / "tp.json"
    rc = _run(["bench", "throughput", "--preset", "mixtral-tiny", "--preset-dir",
               str(tmp_path / "presets"), "--dtype", "float32", "--kv-cache-memory-bytes",
               str(16 * 2**20), "--num-prompts", "3", "--input-len", "12", "--output-len", "6",
               "--compare", "hf", "--output-json", str(out)])
    assert rc == 0
    ours, hf = json.loads(out.read_text())["results"]
    assert ours["num_wrong_output_lens"] == 0 and hf["num_wrong_output_lens"] == 0
    # fp32 greedy on the same Mixtral weights: the engine (native MoE kernel) and HF agree.
    assert hf["comparison"]["greedy_identical_requests"] == "3/3"


def test_unknown_architecture_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        build_checkpoint(tmp_path, {"vocab_size": 300}, architecture="GPT2LMHeadModel")
