"""Multi-step scheduling (`num_scheduler_steps`) end to end on tiny fp32 checkpoints.

Oracle: the engine with one step per round. Greedy and seeded tokens, logprobs, finish reasons
and texts must be identical with rounds of several decode steps, through batching, chunked
prefill, prefix caching, preemption (a tiny KV cache), stop tokens / strings / min_tokens /
max_tokens inside a round, n > 1, penalties, and the requests that make every round one step
(structured output, logits processors). Every block is back once the requests are done.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import SchedulerConfig, create_engine_config
from pagedllm.engine.engine_core import (DEFAULT_CPU_NUM_SCHEDULER_STEPS,
                                         resolve_num_scheduler_steps)
from pagedllm.engine.async_llm import AsyncLLM
from tests.engine.test_async_scheduling import (assert_same_outputs, completions, greedy,
                                                pressure_workload, random_tokens, stop_params)


def _llm(path, steps: int, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_scheduler_steps=steps, **kwargs)


@pytest.fixture(scope="module")
def one_step_llm(tiny_llama):
    """The oracle: one step per round, a large cache, prefix caching off."""
    return _llm(tiny_llama, 1, enable_prefix_caching=False, num_gpu_blocks_override=256,
                max_num_batched_tokens=1024, max_num_seqs=32)


@pytest.fixture(scope="module")
def multi_step_llm(tiny_llama):
    """Rounds of 8 under pressure: 13 usable blocks of 8 tokens (eviction, preemption), a token
    budget of 40 (chunked prefill), prefix caching on."""
    llm = _llm(tiny_llama, 8, enable_prefix_caching=True, block_size=8,
               num_gpu_blocks_override=14, max_num_batched_tokens=40, max_num_seqs=8)
    assert llm.llm_engine.engine_core.scheduler.num_scheduler_steps == 8
    return llm


def _round_sizes(llm: LLM, monkeypatch) -> list[int]:
    """Records the `num_steps` of every SchedulerOutput until the test ends."""
    scheduler = llm.llm_engine.engine_core.scheduler
    sizes: list[int] = []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        sizes.append(out.num_steps)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording)
    return sizes


def test_equal_under_pressure(one_step_llm, multi_step_llm):
    prompts, params = pressure_workload(20)
    outputs = multi_step_llm.generate(prompts, params, use_tqdm=False)
    expected = one_step_llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(outputs, expected)
    stats = multi_step_llm.llm_engine.engine_core.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_stats.hits > 0
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0


def test_stops_inside_a_round(one_step_llm, multi_step_llm, monkeypatch):
    rng = random.Random(5)
    prompts = [random_tokens(rng, rng.randint(4, 20)) for _ in range(7)]
    params = stop_params(one_step_llm, prompts[:6], 16) + [
        greedy(16, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)]
    # Alone (the round ends when its only request stops) and batched (the others go on).
    for i in (0, 2):
        alone = multi_step_llm.generate([prompts[i]], params[i], use_tqdm=False)
        assert completions(alone) == completions(
            one_step_llm.generate([prompts[i]], params[i], use_tqdm=False))
    sizes = _round_sizes(multi_step_llm, monkeypatch)
    outputs = multi_step_llm.generate(prompts, params, use_tqdm=False)
    expected = one_step_llm.generate(prompts, params, use_tqdm=False)
    assert completions(outputs) == completions(expected)
    assert max(sizes) > 1, "no round of several steps ran"
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert len(outputs[0].outputs[0].token_ids) == 4
    assert len(outputs[3].outputs[0].token_ids) == 1
    assert len(outputs[4].outputs) == 3


def test_rounds_never_preempt(tiny_llama):
    """A round's lookahead slots must fit the free blocks: under a cache so small that single
    steps preempt, rounds preempt no more (so recomputes, which are not bit-exact in bf16, stay
    the same) and the outputs, logprobs included, are equal."""
    rng = random.Random(13)
    prompts = [random_tokens(rng, rng.randint(10, 24)) for _ in range(4)]
    params = [greedy(30, logprobs=1), greedy(26),
              SamplingParams(temperature=0.8, seed=3, max_tokens=28, ignore_eos=True),
              greedy(30, logprobs=2)]
    runs = {}
    for steps in (1, 8):
        llm = _llm(tiny_llama, steps, block_size=8, num_gpu_blocks_override=9, max_num_seqs=4)
        runs[steps] = (llm.generate(prompts, params, use_tqdm=False),
                       llm.llm_engine.engine_core.get_stats().num_preemptions)
    assert runs[1][1] > 0
    assert runs[8][1] == runs[1][1]
    assert_same_outputs(runs[8][0], runs[1][0])


def test_host_side_requests_make_rounds_of_one(one_step_llm, multi_step_llm, monkeypatch):
    """A logits processor (or a grammar) needs the host between tokens: while one lives, rounds
    are one step; the free requests in the same batch are unchanged."""
    def ban_token_7(output_ids, logits):
        logits[7] = float("-inf")
        return logits

    rng = random.Random(9)
    prompts = [random_tokens(rng, rng.randint(4, 12)) for _ in range(3)]
    params = [greedy(10), greedy(10, logits_processors=[ban_token_7]), greedy(6)]
    sizes = _round_sizes(multi_step_llm, monkeypatch)
    outputs = multi_step_llm.generate(prompts, params, use_tqdm=False)
    expected = one_step_llm.generate(prompts, params, use_tqdm=False)
    assert completions(outputs) == completions(expected)
    assert set(sizes) == {1}


def test_sliding_window_and_tied_models(tiny_checkpoints):
    """Rounds cross block and window boundaries: Mistral's sliding window (8-16 tokens, shorter
    than the outputs) and a tied-embedding MQA Llama."""
    rng = random.Random(3)
    prompts = [random_tokens(rng, rng.randint(5, 30)) for _ in range(5)]
    params = [greedy(rng.randint(10, 40)) for _ in prompts]
    for name in ("mistral_sliding", "llama_mqa_tied_llama3"):
        kwargs = dict(block_size=8, num_gpu_blocks_override=64, max_num_seqs=8)
        got = _llm(tiny_checkpoints[name], 16, **kwargs).generate(prompts, params,
                                                                  use_tqdm=False)
        want = _llm(tiny_checkpoints[name], 1, **kwargs).generate(prompts, params,
                                                                  use_tqdm=False)
        assert completions(got) == completions(want), name


def test_round_never_passes_max_tokens_or_max_model_len(tiny_llama, monkeypatch):
    llm = _llm(tiny_llama, 8, max_model_len=40, block_size=8, num_gpu_blocks_override=32)
    sizes = _round_sizes(llm, monkeypatch)
    outputs = llm.generate([[5] * 30, [6] * 10], [greedy(50), greedy(5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [10, 5]
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert max(sizes) > 1
    assert llm.llm_engine.engine_core.get_stats().kv_cache_usage == 0.0


def test_defaults_and_bad_values(tiny_llama):
    config = create_engine_config(str(tiny_llama))
    assert config.scheduler_config.num_scheduler_steps is None
    assert resolve_num_scheduler_steps(config, async_scheduling=False) == \
        DEFAULT_CPU_NUM_SCHEDULER_STEPS
    assert resolve_num_scheduler_steps(config, async_scheduling=True) == 1
    spec = create_engine_config(str(tiny_llama), speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    assert resolve_num_scheduler_steps(spec, async_scheduling=False) == 1
    spec4 = create_engine_config(str(tiny_llama), num_scheduler_steps=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative"):
        resolve_num_scheduler_steps(spec4, async_scheduling=False)
    with pytest.raises(ValueError, match="async_scheduling"):
        resolve_num_scheduler_steps(create_engine_config(str(tiny_llama), num_scheduler_steps=4),
                                    async_scheduling=True)
    eplb = replace(config, scheduler_config=replace(config.scheduler_config,
                                                    num_scheduler_steps=4),
                   parallel_config=replace(config.parallel_config, enable_expert_parallel=True,
                                           enable_eplb=True))
    with pytest.raises(ValueError, match="EPLB"):
        resolve_num_scheduler_steps(eplb, async_scheduling=False)
    assert resolve_num_scheduler_steps(
        replace(eplb, scheduler_config=config.scheduler_config), async_scheduling=False) == 1
    for bad in (0, -1, 65, 2.5, True, "4"):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            SchedulerConfig(num_scheduler_steps=bad)


def test_server_engine_defaults_to_one_step(tiny_llama):
    async_llm = AsyncLLM.from_engine_args(str(tiny_llama), dtype="float32",
                                          num_gpu_blocks_override=32)
    try:
        assert async_llm.engine.engine_core.scheduler.num_scheduler_steps == 1
    finally:
        async_llm.shutdown()
