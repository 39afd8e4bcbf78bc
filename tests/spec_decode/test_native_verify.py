"""Greedy verification in the native decode loop (worker/native_verify.py): the acceptance rule
against the rejection sampler's, and end to end the same greedy tokens as without speculation
with the native path taking the steps (and with it switched off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection_sampler import rejection_sample
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.metadata import build_spec_decode_metadata
from pagedllm.worker.native_verify import greedy_accept

PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 61)), [100, 3, 250, 7] * 5,
           [9, 10, 11] * 10, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("seed", range(5))
def test_greedy_accept_equals_rejection_sampler(seed):
    """Random logits and drafts (some equal to the argmax): the tokens the rejection sampler
    emits for greedy rows are greedy_accept's on the rows' argmax."""
    rng = np.random.default_rng(seed)
    vocab, drafts = 50, []
    for _ in range(4):
        drafts.append(rng.integers(0, vocab, int(rng.integers(0, 5))).tolist())
    num_logits = sum(len(d) + 1 for d in drafts)
    logits = torch.from_numpy(rng.standard_normal((num_logits, vocab)).astype(np.float32))
    argmax = logits.argmax(-1).numpy()
    row = 0
    for d in drafts:   # make a prefix of each request's drafts the argmax
        n_ok = int(rng.integers(0, len(d) + 1))
        for j in range(n_ok):
            d[j] = int(argmax[row + j])
        row += len(d) + 1
    last = np.cumsum([len(d) + 1 for d in drafts]) - 1
    spec = build_spec_decode_metadata(drafts, last)
    md = SamplingMetadata(
        temperature=torch.zeros(num_logits), all_greedy=True, all_random=False, top_p=None,
        top_k=None, min_p=None, seeded_rows=[], seeds=[], output_positions=[],
        presence_penalties=None, frequency_penalties=None, repetition_penalties=None,
        prompt_token_ids=None, output_token_ids=None, banned_rows=None, banned_token_ids=None)
    expected, _, _ = rejection_sample(Sampler(torch.device("cpu")), logits, md, spec)
    assert greedy_accept(argmax.astype(np.int64), spec) == expected


def test_greedy_accept_without_drafts():
    assert greedy_accept(np.array([3, 9]), None) == [[3], [9]]


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_native_verify_greedy_unchanged(target, method, monkeypatch):
    """Batched, chunked prefill, twice: the native path takes the decode/verify steps and the
    tokens equal the engine without speculation; with the native loop off, the module path
    runs."""
    reference = _tokens(LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_max"] = 3
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              max_num_batched_tokens=16, speculative_config=spec)
    nv = _runner(llm).native_verify
    assert nv is not None
    assert _tokens(llm) == reference
    # Again: the suffix trees now hold the first run's outputs (drafts get accepted).
    assert _tokens(llm) == reference
    assert nv.num_steps_run > 0
    assert llm.get_stats().spec_decoding_stats.num_accepted_tokens > 0
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_LOOP", "0")
    off = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=spec)
    assert _runner(off).native_verify is None
    assert _tokens(off) == reference


def test_native_verify_skips_non_greedy_rows(target):
    """A request with logprobs (not plain greedy) in the batch: the module path verifies, and
    the logprobs come back."""
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    nv = _runner(llm).native_verify
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert nv.num_steps_run == 0
    assert all(len(o.outputs[0].logprobs) == 12 for o in out)


def _record_proposals(llm) -> list:
    """Wrap the runner's EAGLE proposer (this engine's instance only) to record each call's
    catch-up hidden states and drafts."""
    drafter = _runner(llm).drafter
    calls = []
    propose = drafter.propose

    def recorded(input_ids, positions, hidden, *args):
        drafts = propose(input_ids, positions, hidden, *args)
        calls.append((hidden.clone(), drafts))
        return drafts

    drafter.propose = recorded
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_native_verify_eagle_states_and_drafts(target, tmp_path, monkeypatch, method, dtype):
    """EAGLE (-3) steps verified in the native loop: the hidden states the head reads (the
    final norm's output; EAGLE-3: the streams entering its auxiliary layers, here [0, 1, 1])
    and hence its drafts are bit-identical to the module path's (native loop off), and the
    greedy tokens equal the engine's without speculation."""
    from tests.spec_decode.test_eagle import write_head

    head = write_head(tmp_path / method, method, "authors")
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    kwargs = {"dtype": dtype, "kv_cache_memory_bytes": 8 << 20}
    reference = _tokens(LLM(target, **kwargs))
    llm = LLM(target, max_num_batched_tokens=16, speculative_config=spec, **kwargs)
    nv = _runner(llm).native_verify
    assert nv is not None
    calls = _record_proposals(llm)
    assert _tokens(llm) == reference
    assert nv.num_steps_run > 0
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_LOOP", "0")
    off = LLM(target, max_num_batched_tokens=16, speculative_config=spec, **kwargs)
    assert _runner(off).native_verify is None
    off_calls = _record_proposals(off)
    assert _tokens(off) == reference
    assert len(calls) == len(off_calls)
    for (hidden, drafts), (off_hidden, off_drafts) in zip(calls, off_calls):
        assert hidden.dtype == off_hidden.dtype and torch.equal(hidden, off_hidden)
        assert drafts == off_drafts


def test_loop_states_refuse_bad_aux_layers(target):
    """Auxiliary layers out of order or past the stack: a ValueError naming them, before any
    native call."""
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    loop = _runner(llm).native_verify.loop
    table = torch.zeros(1, 4, dtype=torch.int32)
    for aux in ((1, 0), (0, len(loop.fused.layers))):
        with pytest.raises(ValueError, match="auxiliary layers"):
            loop.run_with_states(np.array([5]), np.array([0]), table, 16, aux)
