"""`pagedllm verify`: PASS on tiny HF and GGUF checkpoints, FAIL when our weights differ from the
reference's, JSON output, usage errors (exit 2), and the per-position comparison itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.verify import compare_sequence, read_prompts
from tests.fixtures.gguf_files import write_gguf

FAST = ["--max-tokens", "6", "--num-prompts", "3", "--kv-cache-memory-bytes", str(8 << 20)]


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("verify_gguf_views")))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def perturbed_llama(tiny_llama, tmp_path_factory) -> Path:
    """tiny_llama with its LM head replaced by other random rows (a wrong weight on our side)."""
    folder = tmp_path_factory.mktemp("perturbed_llama")
    for path in Path(tiny_llama).iterdir():
        if path.is_file():
            shutil.copy(path, folder / path.name)
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = torch.randn(head.shape, generator=g) * head.std() * 20
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_pass_on_a_tiny_hf_checkpoint(tiny_llama, capsys):
    assert main(["verify", str(tiny_llama), *FAST]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("PASS: ")
    assert "[2] chat" in out  # the byte-level tokenizer has a chat template
    assert "top-1 agreement" in out


def test_pass_on_a_tiny_gguf_file_with_json(tiny_llama, tmp_path, capsys):
    path = write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0", "llama")
    # --model, the flag every command takes, names the model as the positional form does.
    assert main(["verify", "--model", str(path), *FAST, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["model"] == str(path)
    assert len(report["prompts"]) == 3
    for prompt in report["prompts"]:
        assert prompt["passed"] and prompt["max_logprob_diff"] < 1e-3
        assert 0 < prompt["num_output_tokens"] <= 6
        assert prompt["divergence"] is None or prompt["divergence"]["near_tie"]


def test_pass_on_a_tiny_gemma3_gguf_file(tiny_checkpoints, tmp_path, capsys):
    # Gemma's GGUF names (ffn_norm = pre-feed-forward norm) and norms stored as 1 + weight: the
    # fixture's norms carry N(0, 0.3) noise, so a wrong map or a missing -1 moves the logprobs.
    # transformers' Gemma GGUF tokenizer needs an unknown token (real Gemma files name one).
    path = write_gguf(tiny_checkpoints["gemma3"], tmp_path / "gemma3.gguf", "Q8_0", "gemma3",
                      extra_metadata={"tokenizer.ggml.unknown_token_id": 0})
    assert main(["verify", str(path), *FAST, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and max(p["max_logprob_diff"] for p in report["prompts"]) < 1e-3


def test_fail_when_our_weights_differ_from_the_reference(perturbed_llama, tiny_llama, capsys):
    assert main(["verify", str(perturbed_llama), "--reference", str(tiny_llama), *FAST,
                 "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["reference"] == str(tiny_llama)
    failed = [p for p in report["prompts"] if not p["passed"]]
    assert failed and all(p["divergence"] and not p["divergence"]["near_tie"] for p in failed)
    assert max(p["max_logprob_diff"] for p in report["prompts"]) > 0.1


def test_prompts_file_and_text_report_of_a_failure(perturbed_llama, tiny_llama, tmp_path,
                                                   capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello world\n\nchat: Say hi.\nline one\\nline two\n")
    assert read_prompts(str(prompts))[1].chat and "\n" in read_prompts(str(prompts))[2].text
    code = main(["verify", str(perturbed_llama), "--reference", str(tiny_llama),
                 "--prompts-file", str(prompts), "--max-tokens", "6",
                 "--kv-cache-memory-bytes", str(8 << 20)])
    out = capsys.readouterr().out
    assert code == 1
    assert out.count("\n[") == 3 and "first divergence at output token" in out
    assert out.strip().splitlines()[-1].startswith("FAIL: ")


@pytest.mark.parametrize("argv", [
    ["verify", "/nonexistent/model.gguf"],
    ["verify", "MODEL", "--num-prompts", "0"],
    ["verify", "MODEL", "--max-tokens", "0"],
    ["verify", "MODEL", "--prompts-file", "/nonexistent/prompts.txt"],
    ["verify", "--max-tokens", "0"],      # no model: the shipped one, then the usage error
    ["verify", "MODEL", "--model", "OTHER"],
])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_bad_prompts_file_or_reference_names_the_flag(tmp_path, capsys):
    # A prompts file that is not UTF-8 said only "'utf-8' codec can't decode byte 0xff ...",
    # a missing --reference folder transformers' "Repo id must be in the form ...".
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9\n")
    for argv, want in ((["--prompts-file", str(latin1)], f"--prompts-file {latin1} is not UTF-8"),
                       (["--prompts-file", str(tmp_path)], f"--prompts-file {tmp_path}: "),
                       (["--reference", str(tmp_path / "gone")],
                        f"--reference {tmp_path / 'gone'}: no such file or folder")):
        assert main(["verify", "MODEL", *argv]) == 2
        assert capsys.readouterr().err.startswith(f"error: {want}")


def test_a_vision_language_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    # transformers' refusal listed every causal-LM config class it knows (~250 names).
    from pagedllm.entrypoints.verify import load_reference_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3"}))
    with pytest.raises(ValueError, match="no causal language model .* text-only") as info:
        load_reference_model(str(tmp_path))
    assert "LlamaConfig" not in str(info.value)


def test_unknown_flag_exits_2():
    with pytest.raises(SystemExit) as e:
        main(["verify", "MODEL", "--no-such-flag"])
    assert e.value.code == 2


def test_compare_sequence_near_tie_and_real_divergence():
    ref = torch.log_softmax(torch.tensor([[5.0, 1.0, 0.0],     # ours 0: agree
                                          [2.0, 2.001, 0.0],   # ours 0, HF 1 by 0.001: near-tie
                                          [0.0, 0.0, 3.0]]),   # ours 0, HF 2 by 3: real
                            dim=-1)
    ours = [0, 0, 0]
    cmp = compare_sequence(ours, [float(ref[i, 0]) + 1e-4 for i in range(3)], ref)
    assert cmp.mismatches == [1, 2]
    assert cmp.gaps[0] == pytest.approx(0.001, abs=1e-5) and cmp.gaps[1] == pytest.approx(3.0)
    assert cmp.top1_agreement == pytest.approx(1 / 3)
    assert cmp.max_logprob_diff == pytest.approx(1e-4, rel=1e-2)
    with pytest.raises(ValueError):
        compare_sequence([], [], ref[:0])
