"""Asynchronous scheduling (`async_scheduling`) end to end on a tiny fp32 Llama.

Oracle: the engine with synchronous steps. Greedy and seeded tokens, finish reasons and texts must
be identical with async scheduling on, through batching, chunked prefill, prefix caching,
preemption (a tiny KV cache), stop tokens / strings / max_tokens (the extra token computed after a
stop is dropped), n > 1, aborts mid-run, and the features that fall back to synchronous steps
(structured output, penalties), and n-gram speculative decoding. On the CPU the steps run in the
uniproc executor's model thread, so the device-side filling of placeholder inputs and the
overlapped output path are exercised as they are on CUDA.
"""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import create_engine_config
from pagedllm.engine.engine_core import EngineCore, resolve_async_scheduling
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.platforms import current_platform

VOCAB_LOW, VOCAB_HIGH = 3, 500


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def completions(outputs) -> list[list[tuple]]:
    return [[(list(c.token_ids), c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
            for o in outputs]


@pytest.fixture(scope="module")
def sync_llm(tiny_llama):
    """The oracle: synchronous steps one at a time, a large cache, prefix caching off."""
    return LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=False,
               num_gpu_blocks_override=256, max_num_batched_tokens=1024, max_num_seqs=32,
               async_scheduling=False, num_scheduler_steps=1)


@pytest.fixture(scope="module")
def async_llm(tiny_llama):
    """Async steps under pressure: 13 usable blocks of 8 tokens (eviction, preemption), a token
    budget of 40 (chunked prefill), prefix caching on."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=True, block_size=8,
              num_gpu_blocks_override=14, max_num_batched_tokens=40, max_num_seqs=8,
              async_scheduling=True)
    assert llm.llm_engine.engine_core.async_scheduling
    return llm


def pressure_workload(max_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """20 prompts, most sharing one of three prefixes, half greedy and half seeded (some with
    logprobs), up to `max_tokens` each."""
    rng = random.Random(2)
    prefixes = [random_tokens(rng, n) for n in (12, 24, 40)]
    prompts = [(prefixes[i % 3] if i % 4 else []) + random_tokens(rng, rng.randint(3, 12))
               for i in range(20)]
    params = [greedy(rng.randint(1, max_tokens)) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, max_tokens),
                             ignore_eos=True, logprobs=2 if i % 3 == 0 else None)
              for i in range(len(prompts))]
    return prompts, params


def assert_same_outputs(outputs, expected) -> None:
    """Tokens, finish reasons, texts and logprobs equal."""
    assert completions(outputs) == completions(expected)
    for out, ref in zip(outputs, expected):
        if out.outputs[0].logprobs is not None:
            assert [list(d) for d in out.outputs[0].logprobs] == \
                [list(d) for d in ref.outputs[0].logprobs]
            assert out.outputs[0].cumulative_logprob == pytest.approx(
                ref.outputs[0].cumulative_logprob)


def stop_params(oracle: LLM, prompts: list[list[int]], max_tokens: int) -> list[SamplingParams]:
    """Per prompt (6 of them), a stop condition that ends it at its own step, read off the
    oracle's free greedy run: a stop token mid-run, a stop token as EOS (not ignored), a stop
    string, max_tokens 1, n=3 seeded, a stop token held back by min_tokens."""
    free = oracle.generate(prompts, greedy(max_tokens), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in free]
    texts = [o.outputs[0].text for o in free]
    return [
        greedy(max_tokens, stop_token_ids=[tokens[0][3]]),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[tokens[1][0]]),
        greedy(max_tokens,
               stop=[texts[2][len(texts[2]) // 2:][:3]] if len(texts[2]) > 4 else None),
        greedy(1),
        SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=max_tokens - 3,
                       ignore_eos=True),
        greedy(max_tokens, stop_token_ids=[tokens[5][5]], min_tokens=7),
    ]


def test_greedy_and_seeded_equal_under_pressure(sync_llm, async_llm):
    prompts, params = pressure_workload(8)
    before = async_llm.get_stats()
    outputs = async_llm.generate(prompts, params, use_tqdm=False)
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(outputs, expected)
    stats = async_llm.get_stats()
    assert stats.num_preemptions > before.num_preemptions
    assert stats.prefix_cache_stats.hits > before.prefix_cache_stats.hits
    # Every block is back once all requests are done (dropped extra tokens leak nothing).
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0


def test_stops_eos_and_n(sync_llm, async_llm):
    rng = random.Random(5)
    prompts = [random_tokens(rng, rng.randint(4, 20)) for _ in range(6)]
    params = stop_params(sync_llm, prompts, 12)   # (max_tokens 1: the extra token is dropped)
    outputs = async_llm.generate(prompts, params, use_tqdm=False)
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    assert completions(outputs) == completions(expected)
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert len(outputs[3].outputs[0].token_ids) == 1
    assert len(outputs[4].outputs) == 3


@pytest.mark.parametrize("feature", ["structured_output", "penalties"])
def test_fallback_features_equal(sync_llm, async_llm, feature):
    """Structured output and penalties need the last token on the host: the engine drains and
    runs synchronous steps while they live; the free requests in the same batch are unchanged."""
    if feature == "structured_output":
        pytest.importorskip("xgrammar")
        special = SamplingParams(temperature=0.0, max_tokens=10,
                                 structured_outputs={"regex": r"\d{4}"})
    else:
        special = greedy(10, repetition_penalty=1.3, presence_penalty=0.5)
    rng = random.Random(9)
    prompts = [random_tokens(rng, rng.randint(4, 12)) for _ in range(4)]
    params = [greedy(10), special, greedy(6),
              SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True)]
    outputs = async_llm.generate(prompts, params, use_tqdm=False)
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    assert completions(outputs) == completions(expected)


def test_abort_mid_run(sync_llm, async_llm):
    rng = random.Random(11)
    prompts = [random_tokens(rng, 6) for _ in range(4)]
    engine = async_llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, greedy(10))
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:
            # Mid-run: one step in flight, its tokens still placeholders.
            core = engine.engine_core
            assert len(core._in_flight) == 1
            assert any(core.scheduler.num_output_placeholders.values())
            engine.abort_request(["abort-1", "abort-2"])
    assert set(finished) == {"abort-0", "abort-3"}
    expected = sync_llm.generate([prompts[0], prompts[3]], greedy(10), use_tqdm=False)
    assert completions([finished["abort-0"], finished["abort-3"]]) == completions(expected)
    stats = async_llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0


def test_ngram_spec_decode_runs_asynchronously(tiny_llama, sync_llm):
    """Speculative decoding keeps async scheduling (placeholder drafts; every method is checked
    in tests/spec_decode/test_async_spec_decode.py)."""
    rng = random.Random(13)
    motif = random_tokens(rng, 5)
    prompts = [motif * 4 + random_tokens(rng, 3), random_tokens(rng, 9)]
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=64,
              async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert llm.llm_engine.engine_core.async_scheduling
    assert completions(llm.generate(prompts, greedy(10), use_tqdm=False)) == completions(
        sync_llm.generate(prompts, greedy(10), use_tqdm=False))


def test_refused_with_mp_and_off_on_cpu_by_default(tiny_llama):
    config = create_engine_config(str(tiny_llama), distributed_executor_backend="mp",
                                  async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling is supported with"):
        EngineCore(config)
    default = resolve_async_scheduling(create_engine_config(str(tiny_llama)), UniProcExecutor)
    assert default == (current_platform.device_type == "cuda")
