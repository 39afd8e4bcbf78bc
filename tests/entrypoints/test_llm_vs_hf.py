"""End to end against Hugging Face transformers (the oracle) and against the engine itself."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

ARCHS = ["llama", "llama_mqa_tied_llama3", "llama_linear_rope_sharded", "mistral", "qwen2",
         "qwen3"]
MAX_TOKENS = 10


def _prompts(vocab_size: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5, 8, 13, 16, 17, 31, 33, 47, 64, 70, 100, 129, 200][:n]
    return [torch.randint(3, vocab_size, (n_tok,), generator=g).tolist() for n_tok in lengths]


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine_tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(tiny_checkpoints, arch):
    path = str(tiny_checkpoints[arch])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20)
    got = _engine_tokens(llm, prompts, GREEDY)
    want = [_hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert got == want


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_hf(tiny_checkpoints, arch):
    """Per-step logits: the engine's sampled-token logprob path vs HF's full forward."""
    path = str(tiny_checkpoints[arch])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=256)
    prompt = _prompts(hf.config.vocab_size)[10]
    tokens = _engine_tokens(llm, [prompt], GREEDY)[0]
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    # Re-run prompt + generated tokens through our model's forward with a fresh request and
    # compare every position's logits with HF (tolerance: fp32 reduction-order noise).
    full = prompt + tokens
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([full])).logits[0]
    ours = _forward_all_logits(llm, runner, full)
    torch.testing.assert_close(ours, hf_logits, atol=2e-4, rtol=2e-4)


def _forward_all_logits(llm: LLM, runner, token_ids: list[int]) -> torch.Tensor:
    from pagedllm.core.sched_output import NewRequestData
    from tests.fixtures.runner_steps import run_step

    num_blocks = -(-len(token_ids) // runner.block_size)
    req = NewRequestData("probe", token_ids, [], GREEDY, list(range(1, 1 + num_blocks)), 0)
    return run_step(runner, req, len(token_ids))


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def reference_tokens(llama_path):
    llm = LLM(llama_path, dtype="float32", kv_cache_memory_bytes=32 << 20,
              enable_prefix_caching=False)
    prompts = _prompts(llm.llm_engine.input_processor.vocab_size)
    return prompts, [_engine_tokens(llm, [p], GREEDY)[0] for p in prompts]


def test_batched_equals_alone(llama_path, reference_tokens):
    prompts, alone = reference_tokens
    llm = LLM(llama_path, dtype="float32", kv_cache_memory_bytes=32 << 20)
    assert _engine_tokens(llm, prompts, GREEDY) == alone


def test_chunked_prefill_equals_unchunked(llama_path, reference_tokens):
    prompts, alone = reference_tokens
    llm = LLM(llama_path, dtype="float32", kv_cache_memory_bytes=32 << 20,
              max_num_batched_tokens=24, max_num_seqs=8)
    assert _engine_tokens(llm, prompts, GREEDY) == alone


def test_preemption_loses_nothing(llama_path, reference_tokens):
    prompts, alone = reference_tokens
    # 40 usable blocks of 16 tokens for 16 requests of up to 210 tokens: forces preemption.
    llm = LLM(llama_path, dtype="float32", num_gpu_blocks_override=41,
              max_num_batched_tokens=64)
    got = _engine_tokens(llm, prompts, GREEDY)
    assert llm.get_stats().num_preemptions > 0
    assert got == alone


def test_seeded_sampling_is_batch_invariant(llama_path):
    llm = LLM(llama_path, dtype="float32", kv_cache_memory_bytes=32 << 20,
              max_num_batched_tokens=32)
    prompts = _prompts(llm.llm_engine.input_processor.vocab_size, n=6, seed=1)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=100 + i, max_tokens=12,
                             ignore_eos=True) for i in range(len(prompts))]
    batched = _engine_tokens(llm, prompts, params)
    alone = [_engine_tokens(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert batched == alone
    again = _engine_tokens(llm, prompts, params)
    assert again == batched
    other = _engine_tokens(llm, prompts[:1], [SamplingParams(temperature=1.0, seed=999,
                                                             max_tokens=12, ignore_eos=True)])
    assert other[0] != batched[0]


@pytest.mark.parametrize("arch", ["llama", "llama_mqa_tied_llama3"])
def test_cpu_paged_attention_matches_torch_sdpa(tiny_checkpoints, arch, monkeypatch):
    """The native CPU attention kernel against the portable backend, end to end: chunked
    prefill (64-token budget), decodes, and prefix-cache hits from repeated prompts."""
    from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
    from pagedllm.layers.attention import Attention

    if not CpuPagedBackend.is_available():
        pytest.skip("CPU kernels did not build")
    path = str(tiny_checkpoints[arch])
    vocab_size = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    prompts = _prompts(vocab_size)
    prompts += prompts[-4:]
    tokens = {}
    for name in ("torch_sdpa", "cpu_paged"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", name)
        llm = LLM(path, dtype="float32", kv_cache_memory_bytes=32 << 20,
                  max_num_batched_tokens=64)
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        assert {m.backend.name for m in model.modules() if isinstance(m, Attention)} == {name}
        tokens[name] = _engine_tokens(llm, prompts, GREEDY)
    assert tokens["cpu_paged"] == tokens["torch_sdpa"]
