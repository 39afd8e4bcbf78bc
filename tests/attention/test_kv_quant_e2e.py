"""int8 / fp8 KV caches end to end on a tiny fp32 checkpoint.

Oracles (DESIGN.md §6): greedy tokens are not expected to equal an fp32-KV run, so the engine is
checked against itself with the quantized cache (prefix caching on/off, eviction + preemption with
chunked prefill, batch vs alone, n-gram speculative decoding), and its prompt logprobs against
the fp32-KV run within the quantization error. The capacity in blocks grows with the smaller
bytes per block.
"""

from __future__ import annotations

import logging
import random
import re

import pytest

from pagedllm import LLM, SamplingParams

VOCAB_LOW, VOCAB_HIGH = 3, 500


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(k)] for k in (20, 36)]
    return [(prefixes[i % 2] if i % 3 else []) +
            [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(3, 14))]
            for i in range(n)]


@pytest.fixture(scope="module")
def int8_reference(tiny_llama):
    """Large cache, prefix caching off, whole prompts in one step: the int8 oracle."""
    return LLM(str(tiny_llama), dtype="float32", kv_cache_dtype="int8",
               enable_prefix_caching=False, num_gpu_blocks_override=256,
               max_num_batched_tokens=1024, max_num_seqs=32)


def test_int8_invariant_to_prefix_caching_preemption_and_batching(tiny_llama, int8_reference):
    prompts = _prompts(0, 12)
    params = _greedy(6)
    expected = _tokens(int8_reference.generate(prompts, params, use_tqdm=False))
    alone = [_tokens(int8_reference.generate([p], params, use_tqdm=False))[0]
             for p in prompts[:4]]
    assert alone == expected[:4]
    # prefix caching on, a small cache (eviction, preemption) and chunked prefill
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype="int8",
              enable_prefix_caching=True, block_size=8, num_gpu_blocks_override=14,
              max_num_batched_tokens=24, max_num_seqs=6)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    again = llm.generate(prompts[:3], params, use_tqdm=False)       # prefix hits
    assert _tokens(again) == expected[:3]
    assert llm.get_stats().num_preemptions > 0
    assert llm.get_stats().prefix_cache_stats.hits > 0


def test_int8_speculative_decoding_keeps_greedy_tokens(tiny_llama, int8_reference):
    rng = random.Random(5)
    motif = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(6)]
    prompts = [motif * 4, motif * 3 + motif[:2]]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype="int8",
              num_gpu_blocks_override=128, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    params = _greedy(10)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(
        int8_reference.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("kv_cache_dtype,tol", [("int8", 0.05), ("fp8_e4m3", 0.3)])
def test_prompt_logprobs_close_to_fp32_kv(tiny_llama, kv_cache_dtype, tol):
    prompts = _prompts(3, 4)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    runs = {}
    for dtype in ("auto", kv_cache_dtype):
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=dtype,
                  num_gpu_blocks_override=64)
        runs[dtype] = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]
                       for o in llm.generate(prompts, params, use_tqdm=False)]
    diffs = [abs(a - b) for ra, rb in zip(runs["auto"], runs[kv_cache_dtype])
             for a, b in zip(ra, rb)]
    assert max(diffs) < tol * max(1.0, max(abs(a) for r in runs["auto"] for a in r))
    assert max(diffs) > 0   # the cache really was quantized


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_capacity_log_counts_scales(tiny_llama):
    """The same byte budget holds 4 * 16 / (16 + 4) = 3.2x the fp32 tokens in int8 (a float32
    scale per token and KV head, head_size 16) and 4x in fp8."""
    budget = 2 * 2 * 16 * 2 * 16 * 4 * 100          # 100 fp32 blocks (2 layers, 2 KV heads)
    handler = _Records()
    log = logging.getLogger("pagedllm.worker.worker")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        for dtype in ("auto", "int8", "fp8_e4m3"):
            LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=dtype,
                kv_cache_memory_bytes=budget)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    blocks = [int(re.search(r"KV cache: (\d+) blocks", m).group(1))
              for m in handler.messages if m.startswith("KV cache:")]
    assert blocks == [100 - 1, budget // (2 * 2 * 16 * 2 * (16 + 4)) - 1, 400 - 1]
    assert any("int8" in m for m in handler.messages)
