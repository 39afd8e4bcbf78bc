"""Speculative decoding end to end: greedy output unchanged, with chunked prefill, prefix caching,
preemption, stop conditions inside an accepted run, max_tokens mid-run and logprobs."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

# Repetitive prompts give the n-gram proposer something to find.
PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 61)), [100, 3, 250, 7] * 5,
           [9, 10, 11] * 10, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def reference(target):
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20)
    return _tokens(llm)


def _spec(method, tiny_checkpoints, k=3):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    # A different tiny model with the same tokenizer: low acceptance, still exact output.
    return {"method": "draft_model", "num_speculative_tokens": k,
            "model": str(tiny_checkpoints["llama_mqa_tied_llama3"])}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
def test_greedy_unchanged_batched_chunked(target, reference, tiny_checkpoints, method):
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16,
              speculative_config=_spec(method, tiny_checkpoints))
    assert _tokens(llm) == reference
    stats = llm.get_stats().spec_decoding_stats
    assert stats.num_draft_tokens > 0


def test_self_draft_accepts_everything(target, reference):
    """The target as its own draft: every draft must be accepted (checks the draft's KV)."""
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "draft_model", "model": target,
                                  "num_speculative_tokens": 4})
    assert _tokens(llm) == reference
    stats = llm.get_stats().spec_decoding_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.mean_accepted_length > 3


def test_preemption_and_prefix_caching(target, reference, tiny_checkpoints):
    llm = LLM(target, dtype="float32", num_gpu_blocks_override=12, max_num_batched_tokens=32,
              speculative_config=_spec("draft_model", tiny_checkpoints))
    assert _tokens(llm) == reference
    assert llm.get_stats().num_preemptions > 0
    assert _tokens(llm) == reference  # again, now with prefix-cache hits


def test_stops_inside_accepted_run(target, reference):
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "draft_model", "model": target,
                                  "num_speculative_tokens": 4})
    ref = reference[0]
    stop_id = ref[6]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop_id) + 1] and out.stop_reason == stop_id
    for max_tokens in (1, 2, 5, 7):
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[:max_tokens] and out.finish_reason == "length"
    text = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[5:8]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"


def test_logprobs_with_spec_decode(target):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    plain = LLM(target, dtype="float32", kv_cache_memory_bytes=4 << 20).generate(
        PROMPTS[:2], params, use_tqdm=False)
    spec = LLM(target, dtype="float32", kv_cache_memory_bytes=4 << 20,
               speculative_config={"method": "draft_model", "model": target,
                                   "num_speculative_tokens": 3}).generate(
        PROMPTS[:2], params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
                assert la[t].rank == lb[t].rank


def test_seeded_random_sampling_is_reproducible(target):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    a = _tokens(LLM(target, dtype="float32", kv_cache_memory_bytes=4 << 20,
                    speculative_config=spec), params=params)
    b = _tokens(LLM(target, dtype="float32", kv_cache_memory_bytes=4 << 20,
                    speculative_config=spec), params=params)
    assert a == b


def test_bad_speculative_config(target):
    with pytest.raises(ValueError, match="method"):
        LLM(target, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="model"):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
