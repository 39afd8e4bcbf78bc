"""Phi-3 end to end against HF `transformers` (fp32, greedy) on tiny random checkpoints: default
RoPE; LongRoPE over whole heads; LongRoPE with partial RoPE and tied embeddings. With LongRoPE
(original_max_position_embeddings 32) the prompts either stay within 32 tokens with their
completions (short factors throughout) or are longer than 32 (long factors from the first
token). A sequence that crosses 32 while decoding is left out: HF's `generate` then drops its
cache and recomputes every key with the long factors, which the engine does not (see the NOTE in
`models/phi3.py`). Logprobs are compared too: argmax alone hides small RoPE errors."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from tests.distributed.common import run

VARIANTS = ["phi3", "phi3_longrope", "phi3_longrope_partial"]
# torch_sdpa (the reference backend, compared with cpu_paged op by op in
# tests/attention/test_backends.py) runs these model checks in the slow run only.
BACKENDS = [pytest.param("torch_sdpa", marks=pytest.mark.slow),
            pytest.param("cpu_paged", marks=pytest.mark.skipif(
                not CpuPagedBackend.is_available(), reason="CPU kernels did not build"))]
PROMPT_LENGTHS = (3, 15, 22, 33, 40, 57)   # 22 + 10 tokens = 32: still short
MAX_TOKENS = 10
LOGPROB_TOL = 2e-4


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in PROMPT_LENGTHS]


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_and_logprobs_match_hf(tiny_checkpoints, variant, backend, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
    path = str(tiny_checkpoints[variant])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = _prompts()
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt)
        completion = out.outputs[0]
        assert list(completion.token_ids) == want_tokens, f"prompt of {len(prompt)} tokens"
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)


def test_tp2_loads_fused_tensors_per_rank(tiny_checkpoints):
    """tp=2: each rank must take its own q/k/v heads and gate/up rows out of the fused
    checkpoint tensors (a contiguous half of a fused tensor would give other tokens)."""
    path = tiny_checkpoints["phi3_longrope"]
    params = [SamplingParams(max_tokens=8, temperature=0.0)]
    expected = run(path, params)
    assert run(path, params, tensor_parallel_size=2, distributed_executor_backend="mp") == expected
