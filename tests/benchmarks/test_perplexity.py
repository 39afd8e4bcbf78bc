"""`pagedllm bench perplexity` on a tiny fp32 checkpoint against a direct Hugging Face computation
over the same windows (oracle: HF transformers, DESIGN.md §6), and with a quantized KV cache."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.benchmarks.perplexity import BUILTIN_TEXT, split_windows

WINDOW, MAX_WINDOWS = 96, 3


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _hf_perplexity(model_dir: Path, text: str) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(text, add_special_tokens=False)
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW)][:MAX_WINDOWS]
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w])
            logprobs = model(x).logits[0, :-1].double().log_softmax(-1)
            total -= float(logprobs.gather(1, x[0, 1:, None]).sum())
            count += len(w) - 1
    return count, total / count


def test_split_windows():
    assert split_windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]   # [6] alone is dropped
    assert split_windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="window"):
        split_windows(list(range(8)), 1)
    with pytest.raises(ValueError, match="at least 2"):
        split_windows([5], 4)


def test_perplexity_matches_hf(tiny_llama: Path, tmp_path: Path):
    text_file = tmp_path / "text.txt"
    text_file.write_text(BUILTIN_TEXT)
    runs = {}
    for kv in ("auto", "int8"):
        out = tmp_path / f"ppl_{kv}.json"
        assert _run(["bench", "perplexity", "--model", str(tiny_llama), "--dtype", "float32",
                     "--max-model-len", str(WINDOW), "--max-windows", str(MAX_WINDOWS),
                     "--kv-cache-dtype", kv, "--input-file", str(text_file),
                     "--output-json", str(out)]) == 0
        runs[kv] = json.loads(out.read_text())["results"][0]
    ours = runs["auto"]
    count, mean_nll = _hf_perplexity(tiny_llama, BUILTIN_TEXT)
    assert ours["num_windows"] == MAX_WINDOWS and ours["num_tokens"] == count
    assert math.isfinite(ours["perplexity"]) and ours["perplexity"] > 1
    assert ours["mean_nll"] == pytest.approx(mean_nll, rel=1e-3)
    assert ours["perplexity"] == pytest.approx(math.exp(mean_nll), rel=1e-3)
    int8 = runs["int8"]
    assert int8["kv_cache_dtype"] == "int8" and int8["num_tokens"] == count
    assert int8["mean_nll"] != ours["mean_nll"]
    assert int8["mean_nll"] == pytest.approx(ours["mean_nll"], rel=0.05)


def test_perplexity_rejects_a_window_past_max_model_len(tiny_llama: Path):
    with pytest.raises(ValueError, match="max_model_len"):
        _run(["bench", "perplexity", "--model", str(tiny_llama), "--dtype", "float32",
              "--max-model-len", "32", "--window", "64"])


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed")
def test_perplexity_compare_llamacpp_scores_the_same_windows(tiny_llama: Path, tmp_path: Path):
    """On an F32 GGUF file of the tiny model, llama.cpp scores the same tokens and lands close
    to the engine (its KV cache is f16)."""
    from tests.fixtures.gguf_files import write_gguf

    gguf_file = write_gguf(tiny_llama, tmp_path / "tiny-f32.gguf", "F32")
    out = tmp_path / "ppl.json"
    assert _run(["bench", "perplexity", "--model", str(gguf_file), "--dtype", "float32",
                 "--max-model-len", str(WINDOW), "--max-windows", str(MAX_WINDOWS),
                 "--compare", "llamacpp", "--output-json", str(out)]) == 0
    ours, theirs = json.loads(out.read_text())["results"]
    assert theirs["backend"] == "llama.cpp" and theirs["gguf"] == str(gguf_file)
    assert theirs["num_tokens"] == ours["num_tokens"] and theirs["num_windows"] == MAX_WINDOWS
    assert theirs["perplexity"] == pytest.approx(ours["perplexity"], rel=1e-2)
    assert theirs["perplexity_ratio"] == pytest.approx(ours["perplexity"] / theirs["perplexity"])


def test_a_bad_input_file_is_refused_naming_it_before_the_model_loads(tmp_path: Path, capsys):
    # A folder was an IsADirectoryError traceback, a non-UTF-8 file a bare codec error; both
    # only after the model had loaded. The model here does not exist: the file is checked first.
    from pagedllm.entrypoints.cli import main

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9 au lait\n")
    for path, want in ((tmp_path, f"--input-file {tmp_path}: "),
                       (latin1, f"--input-file {latin1} is not UTF-8 text"),
                       (tmp_path / "gone.txt", f"--input-file {tmp_path / 'gone.txt'}: ")):
        assert main(["bench", "perplexity", "--model", str(tmp_path / "no-model"),
                     "--input-file", str(path)]) == 1
        assert capsys.readouterr().err.startswith(f"error: {want}")
