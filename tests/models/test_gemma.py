"""Gemma 2 and Gemma 3 (text) end to end, on tiny random checkpoints whose sliding windows (8 or 16
tokens) are shorter than the prompts.

Oracles (DESIGN.md §6): HF `transformers` in fp32 (greedy tokens equal, logprobs of the generated
and of the prompt tokens within fp32 noise) with both CPU attention backends; and the engine
against itself (chunked prefill with a small token budget, prefix caching with shared prefixes
longer than the window, small blocks: same tokens and logprobs as one unchunked, uncached run).
Logprobs matter here: a tied random model tends to repeat its last token whatever its attention
does, and a final soft-cap never changes an argmax.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.config import create_engine_config
from pagedllm.layers.attention import Attention

VARIANTS = ["gemma3", "gemma3_untied_softcap", "gemma2", "gemma2_mqa_tied"]
# torch_sdpa (the reference backend, compared with cpu_paged op by op in
# tests/attention/test_backends.py) runs these model checks in the slow run only.
BACKENDS = [pytest.param("torch_sdpa", marks=pytest.mark.slow),
            pytest.param("cpu_paged", marks=pytest.mark.skipif(
                not CpuPagedBackend.is_available(), reason="CPU kernels did not build"))]
PROMPT_LENGTHS = (3, 20, 41, 57)
MAX_TOKENS = 8
# fp32 reduction-order noise through 3-4 layers (the packed CPU GEMM sums each output along K
# in order, 2-4x the rounding error of the dot-product kernel: up to 2.1e-4 seen on Mixtral).
LOGPROB_TOL = 4e-4
VOCAB_LOW, VOCAB_HIGH = 3, 500  # clear of the special tokens of the tiny vocabularies


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in PROMPT_LENGTHS]


def _params(prompt_logprobs: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0,
                          prompt_logprobs=0 if prompt_logprobs else None)


def _tokens_and_logprobs(outputs) -> tuple[list[list[int]], list[list[float]]]:
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outputs]
    return tokens, logprobs


def _prompt_logprobs(output) -> list[float]:
    """Engine logprob of prompt token i + 1 given tokens [0, i], for every i."""
    ids = output.prompt_token_ids
    return [step[t].logprob for t, step in zip(ids[1:], output.prompt_logprobs[1:])]


def assert_matches_hf(llm: LLM, want_tokens, want_logprobs, want_prompt_logprobs) -> None:
    """Greedy tokens equal HF's and the logprobs of generated and prompt tokens are within
    LOGPROB_TOL of HF's (the `hf_reference` triple)."""
    outputs = llm.generate(_prompts(), _params(prompt_logprobs=True), use_tqdm=False)
    tokens, logprobs = _tokens_and_logprobs(outputs)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=LOGPROB_TOL,
                                   rtol=0)
    for output, want in zip(outputs, want_prompt_logprobs):
        torch.testing.assert_close(torch.tensor(_prompt_logprobs(output)), torch.tensor(want),
                                   atol=LOGPROB_TOL, rtol=0)


def hf_greedy_reference(path) -> tuple[list, list, list]:
    """HF fp32 on the checkpoint at `path`, for every `_prompts()` prompt: (greedy tokens of
    MAX_TOKENS steps, their logprobs, the prompt tokens' logprobs)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, logprobs, prompt_logprobs = [], [], []
    for prompt in _prompts():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
        new = out.sequences[0, len(prompt):]
        steps = torch.stack(out.logits)[:, 0].log_softmax(-1)                  # [T, vocab]
        tokens.append(new.tolist())
        logprobs.append(steps.gather(1, new[:, None])[:, 0].tolist())
        with torch.inference_mode():
            full = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)          # [P, vocab]
        target = torch.tensor(prompt[1:])
        prompt_logprobs.append(full[:-1].gather(1, target[:, None])[:, 0].tolist())
    return tokens, logprobs, prompt_logprobs


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoints):
    """variant -> (greedy tokens, their logprobs, prompt-token logprobs) from HF in fp32."""
    cache: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = hf_greedy_reference(tiny_checkpoints[variant])
        return cache[variant]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_logprobs_match_hf(tiny_checkpoints, hf_reference, variant, backend,
                                      monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
    want_tokens, want_logprobs, want_prompt_logprobs = hf_reference(variant)
    llm = LLM(str(tiny_checkpoints[variant]), dtype="float32", kv_cache_memory_bytes=8 << 20)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert {m.backend.name for m in layers} == {backend}
    assert any(m.sliding_window is not None for m in layers)
    assert any(m.sliding_window is None for m in layers)
    assert_matches_hf(llm, want_tokens, want_logprobs, want_prompt_logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_and_prefix_caching_change_nothing(tiny_checkpoints, variant, backend,
                                                           monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(37)]  # > every window
    prompts = _prompts()[1::2] + [prefix + [rng.randrange(VOCAB_LOW, VOCAB_HIGH)
                                            for _ in range(n)] for n in (1, 6, 19)]
    path = str(tiny_checkpoints[variant])
    reference = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20,
                    enable_prefix_caching=False, max_num_batched_tokens=2048)
    want = _tokens_and_logprobs(reference.generate(prompts, _params(), use_tqdm=False))
    # Blocks of 8 (windows start mid-block), 11-token steps of up to 3 requests, and the shared
    # prefix served from the cache: the two requests after the first that holds it start 32
    # tokens in.
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8,
              enable_prefix_caching=True, max_num_batched_tokens=11, max_num_seqs=3)
    outputs = llm.generate(prompts[:3], _params(), use_tqdm=False)
    outputs += [llm.generate(p, _params(), use_tqdm=False)[0] for p in prompts[3:]]
    assert [o.num_cached_tokens for o in outputs[-3:]] == [0, 32, 32]
    tokens, logprobs = _tokens_and_logprobs(outputs)
    assert tokens == want[0]
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(want[1], [])),
                               atol=LOGPROB_TOL, rtol=0)


def test_context_is_not_capped_at_the_window(tiny_checkpoints):
    """Gemma's layers apply their own windows, so max_model_len is the model's full length."""
    config = create_engine_config(str(tiny_checkpoints["gemma2"]))
    assert config.max_model_len == 1024
