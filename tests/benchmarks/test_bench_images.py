"""`pagedllm bench images` (issue #42): the vision-language presets' layouts and the bench's
code path on the tiny presets against HF `generate`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.benchmarks.images import image_workload, parse_image_size
from pagedllm.benchmarks.vlm_presets import VLM_PRESETS, vlm_preset_path


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _bench(tmp_path: Path, preset: str) -> list[dict]:
    out = tmp_path / f"{preset}.json"
    rc = _run(["bench", "images", "--preset", preset, "--preset-dir", str(tmp_path / "presets"),
               "--dtype", "float32", "--kv-cache-memory-bytes", str(16 * 2**20),
               "--num-prompts", "3", "--output-len", "5", "--compare", "hf",
               "--output-json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())["results"]


@pytest.mark.parametrize("name,low,high", [("smolvlm-200m", 190e6, 230e6),
                                           ("qwen2.5-vl-200m", 190e6, 230e6)])
def test_200m_presets_have_their_size_and_a_large_vision_tower(name: str, low: float,
                                                               high: float):
    import transformers

    preset = VLM_PRESETS[name]
    text = dict(preset.text, vocab_size=preset.vocab_size, tie_word_embeddings=False)
    if preset.family == "idefics3":
        config = transformers.Idefics3Config(vision_config=preset.vision,
                                             text_config=dict(text, model_type="llama"),
                                             **preset.extra)
    else:
        config = transformers.Qwen2_5_VLConfig(vision_config=preset.vision, text_config=text)
    with torch.device("meta"):
        model = getattr(transformers, preset.hf_class)(config)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters()
                 if any(k in n for k in ("vision", "visual", "connector")))
    assert low < total < high
    assert 0.3 < vision / total < 0.5


def test_smolvlm_tiny_bench_runs_the_same_requests_as_hf(tmp_path: Path):
    ours, hf = _bench(tmp_path, "smolvlm-tiny")
    assert ours["num_wrong_output_lens"] == 0 and hf["num_wrong_output_lens"] == 0
    # Each image encoded once, and the encoder's time is a part of the timed call.
    assert ours["num_encoded_images"] == 3
    assert 0 < ours["encoder_s"] < ours["elapsed_s"]
    assert ours["num_input_tokens"] == hf["num_input_tokens"]
    assert hf["comparison"]["greedy_identical_requests"] == "3/3"
    assert hf["comparison"]["output_tokens_per_s_ratio"] > 0


@pytest.mark.slow
def test_qwen2_5_vl_tiny_bench_runs_the_same_requests_as_hf(tmp_path: Path):
    ours, hf = _bench(tmp_path, "qwen2.5-vl-tiny")
    assert ours["num_encoded_images"] == 3 and ours["num_wrong_output_lens"] == 0
    assert ours["num_input_tokens"] == hf["num_input_tokens"]
    assert hf["comparison"]["greedy_identical_requests"] == "3/3"


def test_workload_is_seeded_and_bad_input_is_named(tmp_path: Path):
    texts, images = image_workload("idefics3", 2, (40, 30), seed=5)
    again = image_workload("idefics3", 2, (40, 30), seed=5)[1]
    assert [t.count("<image>") for t in texts] == [1, 1]
    assert [im.tobytes() for im in images] == [im.tobytes() for im in again]
    assert images[0].tobytes() != images[1].tobytes()
    assert parse_image_size("256x192") == (256, 192)
    with pytest.raises(ValueError, match="--image-size"):
        parse_image_size("256")
    with pytest.raises(ValueError, match="unknown image preset"):
        vlm_preset_path("no-such-vlm", tmp_path)
    with pytest.raises(ValueError, match="bench images supports"):
        _run(["bench", "images", "--model", vlm_text_only(tmp_path)])
    with pytest.raises(ValueError, match="--hf-batch-size must be >= 1"):
        _run(["bench", "images", "--preset", "smolvlm-tiny", "--hf-batch-size", "0"])


def vlm_text_only(tmp_path: Path) -> str:
    """A folder whose config names a text-only architecture (never loaded)."""
    folder = tmp_path / "text-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return str(folder)
