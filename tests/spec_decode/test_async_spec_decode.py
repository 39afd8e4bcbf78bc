"""Asynchronous scheduling with speculative decoding (placeholder drafts; core/scheduler.py,
worker/async_drafts.py).

Oracle: the engine without speculation and the same speculative engine with synchronous steps.
Greedy tokens must be identical for every method (n-gram, suffix, draft model, EAGLE, EAGLE-3,
MTP) under chunked prefill and preemption (a cache of a few blocks), while the engine really
schedules step N+1 with placeholder drafts before step N's output reached the scheduler. Seeded
sampling is not compared token by token: near max_tokens the optimistic positions leave fewer
draft slots, so the random stream differs (its distribution does not: rejection sampling is
exact for any number of drafts).
"""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.sched_output import (DRAFT_PLACEHOLDER, CachedRequestData, ModelRunnerOutput,
                                        SchedulerOutput)
from pagedllm.worker.async_drafts import AsyncDrafts
from tests.spec_decode.test_eagle import write_head

PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 61)), [100, 3, 250, 7] * 5,
           [9, 10, 11] * 10, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# Chunks of at most 16 tokens, 8 usable blocks of 16 tokens for 5 requests: preemptions.
PRESSURE = {"num_gpu_blocks_override": 9, "max_num_batched_tokens": 16}


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def reference(target):
    return _tokens(LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20))


@pytest.fixture(scope="module")
def spec_configs(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_spec_heads")
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
            "suffix": {"method": "suffix", "num_speculative_tokens": 3},
            # The target as its own draft: every draft accepted (long optimistic runs).
            "draft_model": {"method": "draft_model", "num_speculative_tokens": 3,
                            "model": str(tiny_checkpoints["llama"])},
            "eagle": {"method": "eagle", "num_speculative_tokens": 3,
                      "model": str(write_head(root / "eagle", "eagle", "speculators"))},
            "eagle3": {"method": "eagle3", "num_speculative_tokens": 3,
                       "model": str(write_head(root / "eagle3", "eagle3", "authors"))}}


class StepSpy:
    """Records, for every `schedule()`, how many steps were in flight and whether it placed
    placeholder drafts or optimistic positions."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.engine_core
        assert core.async_scheduling
        self.in_flight: list[int] = []
        self.placeholders = self.optimistic = 0
        schedule = core.scheduler.schedule

        def spy() -> SchedulerOutput:
            self.in_flight.append(len(core._in_flight))
            out = schedule()
            self.placeholders += sum(DRAFT_PLACEHOLDER in d
                                     for d in out.scheduled_spec_decode_tokens.values())
            self.optimistic += len(out.optimistic_req_ids)
            return out

        core.scheduler.schedule = spy

    def check_overlapped(self) -> None:
        assert max(self.in_flight) >= 1, "no step was scheduled while another ran"
        assert self.placeholders > 0 and self.optimistic > 0


def _check_method(target_path: str, spec: dict, want: list[list[int]], prompts=PROMPTS,
                  params=GREEDY, **engine_kwargs) -> None:
    kwargs = {"dtype": "float32", "speculative_config": spec, **engine_kwargs}
    sync = _tokens(LLM(target_path, async_scheduling=False, **kwargs), prompts, params)
    llm = LLM(target_path, async_scheduling=True, **kwargs)
    spy = StepSpy(llm)
    assert _tokens(llm, prompts, params) == sync == want
    spy.check_overlapped()
    stats = llm.get_stats()
    assert stats.spec_decoding_stats.num_draft_tokens > 0
    assert stats.num_preemptions > 0
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle", "eagle3"])
def test_greedy_identical_async_on_off_chunked_preempted(target, reference, spec_configs,
                                                         method):
    _check_method(target, spec_configs[method], reference, **PRESSURE)


def test_mtp_greedy_identical_async_on_off(tmp_path_factory, byte_level_tokenizer_dir):
    from tests.models.test_deepseek import build_checkpoint
    from tests.models.test_gemma import _params, _prompts
    from tests.spec_decode.test_mtp import add_mtp_tensors

    path = build_checkpoint("v3", tmp_path_factory.mktemp("mtp") / "v3_mtp",
                            byte_level_tokenizer_dir, {"num_nextn_predict_layers": 1})
    add_mtp_tensors(path)
    prompts, params = _prompts(), _params()
    want = _tokens(LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20), prompts,
                   params)
    _check_method(str(path), {"method": "mtp", "num_speculative_tokens": 2}, want, prompts,
                  params,
                  num_gpu_blocks_override=10, block_size=8, max_model_len=96,
                  max_num_batched_tokens=7, max_num_seqs=4)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_stops_n_min_tokens_and_logprobs_equal_synchronous(target, spec_configs, method):
    """The async-scheduling pressure workload (shared prefixes, 13 usable blocks of 8 tokens,
    a 40-token budget, prefix caching) in greedy form with stop tokens inside accepted runs,
    min_tokens, n = 2 and logprobs: outputs, finish reasons and logprobs equal synchronous
    steps of the same engine."""
    from tests.engine.test_async_scheduling import assert_same_outputs, pressure_workload

    prompts, _ = pressure_workload(24)
    rng = random.Random(5)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24),
                             ignore_eos=i % 5 != 1, logprobs=2 if i % 3 == 0 else None,
                             n=2 if i % 7 == 0 else 1, min_tokens=3 if i % 6 == 2 else 0,
                             stop_token_ids=rng.sample(range(3, 500), 40) if i % 5 == 1 else None)
              for i in range(len(prompts))]
    kwargs = {"dtype": "float32", "enable_prefix_caching": True, "block_size": 8,
              "num_gpu_blocks_override": 14, "max_num_batched_tokens": 40, "max_num_seqs": 8,
              "speculative_config": spec_configs[method]}
    expected = LLM(target, async_scheduling=False, **kwargs).generate(prompts, params,
                                                                      use_tqdm=False)
    llm = LLM(target, async_scheduling=True, **kwargs)
    spy = StepSpy(llm)
    assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), expected)
    spy.check_overlapped()
    assert llm.get_stats().num_preemptions > 0
    assert any(c.finish_reason == "stop" for o in expected for c in o.outputs)


def test_structured_request_switches_to_synchronous_steps(target, reference, spec_configs):
    """A structured request (synchronous steps while it lives) arriving among async steps: the
    in-flight steps drain, the drafts held by the runner and the scheduler's real drafts meet
    at the switch (and again at the switch back, if it finishes first)."""
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20, async_scheduling=True,
              speculative_config=spec_configs["draft_model"])
    spy = StepSpy(llm)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    choice = SamplingParams(temperature=0.0, max_tokens=4,
                            structured_outputs={"choice": ["yes", "no"]})
    finished, num_steps = {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        num_steps += 1
        if num_steps == 3:
            spy.check_overlapped()
            engine.add_request("structured", "Answer:", choice)
    assert [list(finished[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))] == \
        reference
    assert finished["structured"].outputs[0].text in ("yes", "no")


def test_resolve_fills_placeholders_and_corrects_positions():
    drafts = AsyncDrafts()
    so = SchedulerOutput.make_empty()
    so.scheduled_cached_reqs = CachedRequestData(["a", "b"], [([],), ([],)], [10, 20])
    so.num_scheduled_tokens = {"a": 4, "b": 1}
    so.total_num_scheduled_tokens = 5
    so.scheduled_spec_decode_tokens = {"a": [7, 8, 9]}
    # Step N (real drafts: passes unchanged): a accepts 1 of its 3 drafts; b samples one token
    # after its prefill; both get drafts for N+1.
    assert drafts.resolve(so) is so
    out = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1, 2], [3]],
                            draft_token_ids={"a": [6], "b": [4, 5]})
    drafts.record(out)
    assert drafts.num_rejected == {"a": 2} and out.num_draft_tokens == {}
    # Step N+1, scheduled before N's output: 3 placeholder slots each (a: 1 draft kept, b: 2),
    # and a's position was counted with all 3 of its drafts of step N accepted.
    so.scheduled_cached_reqs = CachedRequestData(["a", "b"], [([],), ([],)], [14, 20])
    so.optimistic_req_ids = {"a"}
    so.num_scheduled_tokens = {"a": 4, "b": 4}
    so.total_num_scheduled_tokens = 8
    so.scheduled_spec_decode_tokens = {"a": [DRAFT_PLACEHOLDER] * 3,
                                       "b": [DRAFT_PLACEHOLDER] * 3}
    step = drafts.resolve(so)
    assert step.scheduled_spec_decode_tokens == {"a": [6], "b": [4, 5]}
    assert step.num_scheduled_tokens == {"a": 2, "b": 3} and step.total_num_scheduled_tokens == 5
    assert step.scheduled_cached_reqs.num_computed_tokens == [12, 20]
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}   # the scheduler's object is untouched
    out = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[9, 9], [8]])
    drafts.record(out)
    assert drafts.num_rejected == {"a": 2, "b": 3} and out.num_draft_tokens == {"a": 1, "b": 2}
    so.scheduled_spec_decode_tokens = {"b": [DRAFT_PLACEHOLDER, 3]}
    with pytest.raises(RuntimeError, match="placeholder and real drafts mixed"):
        drafts.resolve(so)


def _runner_output(tokens: dict[str, list[int]], drafts: dict[str, list[int]],
                   **kwargs) -> ModelRunnerOutput:
    req_ids = list(tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                             [tokens[r] for r in req_ids], draft_token_ids=drafts, **kwargs)


def test_scheduler_placeholder_drafts_rollback_and_preemption_in_flight():
    """The scheduler's bookkeeping alone, steps driven by hand in the engine's order (step
    N+1 scheduled before N's update): placeholders, optimistic positions, rollbacks, stats
    of verified drafts, and a request preempted while its draft step runs."""
    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.core.request import Request, RequestStatus
    from pagedllm.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                      CacheConfig(block_size=4, enable_prefix_caching=False), max_model_len=64,
                      num_blocks=7, async_scheduling=True, num_speculative_tokens=2)
    a, b = (Request(r, [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=18), 18)
            for r in "ab")
    sched.add_request(a)
    sched.add_request(b)
    s0 = sched.schedule()   # both prefill 5 tokens (2 blocks each) and sample
    assert a.spec_token_ids == [DRAFT_PLACEHOLDER] * 2 and not s0.optimistic_req_ids
    sched.update_from_output(s0, _runner_output({"a": [6], "b": [6]},
                                                {"a": [7, 8], "b": [7, 8]}))
    assert a.spec_token_ids == [7, 8]   # nothing scheduled since: the real drafts
    s1 = sched.schedule()
    assert s1.scheduled_spec_decode_tokens == {"a": [7, 8], "b": [7, 8]}
    assert a.spec_token_ids == [DRAFT_PLACEHOLDER] * 2 and a.num_computed_tokens == 8
    s2 = sched.schedule()   # s1 still running: placeholder drafts, optimistic positions
    assert s2.num_scheduled_tokens == {"a": 3, "b": 3}
    assert s2.scheduled_spec_decode_tokens == {r: [DRAFT_PLACEHOLDER] * 2 for r in "ab"}
    assert s2.optimistic_req_ids == {"a", "b"} and a.num_computed_tokens == 11
    # s1: a accepted 1 of 2 drafts, b none; the drafts they bring are already scheduled.
    sched.update_from_output(s1, _runner_output({"a": [7, 9], "b": [10]},
                                                {"a": [1, 1], "b": [1, 1]}))
    assert (a.num_tokens, a.num_computed_tokens) == (8, 10)
    assert (b.num_tokens, b.num_computed_tokens) == (7, 9)
    assert a.spec_token_ids == [DRAFT_PLACEHOLDER] * 2
    # s3 (before s2's update): a needs a fourth block, none is free: b is preempted while its
    # s2 drafts are verified.
    s3 = sched.schedule()
    assert s3.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    assert s3.optimistic_req_ids == {"a"}
    # s2: a verified 1 draft only (the runner had one), accepted it; b's tokens arrive late.
    sched.update_from_output(s2, _runner_output({"a": [11, 12], "b": [13]}, {},
                                                num_draft_tokens={"a": 1}))
    assert (a.num_tokens, a.num_computed_tokens) == (10, 12)
    assert (b.num_tokens, b.num_computed_tokens, b.spec_token_ids) == (8, 0, [])
    stats = sched.spec_decoding_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (2 + 2 + 1 + 2, 1 + 0 + 1 + 0)
    # s3: the runner had no draft for a's slots (counted as no verification at all).
    sched.update_from_output(s3, _runner_output({"a": [16]}, {"a": [17]},
                                                num_draft_tokens={"a": 0}))
    assert stats.num_drafts == 4
    assert (a.num_tokens, a.num_computed_tokens, a.spec_token_ids) == (11, 10, [17])
    sched.finish_requests("a")   # (room for b)
    s4 = sched.schedule()   # b is recomputed from scratch, without drafts
    assert [r.req_id for r in s4.scheduled_new_reqs] == ["b"]
    assert s4.num_scheduled_tokens["b"] == 8 and "b" not in s4.scheduled_spec_decode_tokens


def test_default_stays_synchronous_with_speculation(target, monkeypatch):
    """async_scheduling=None: on for CUDA, but not with speculation (not measured there)."""
    from types import SimpleNamespace

    from pagedllm.config import create_engine_config
    from pagedllm.engine import engine_core
    from pagedllm.executor.uniproc import UniProcExecutor

    monkeypatch.setattr(engine_core, "current_platform", SimpleNamespace(device_type="cuda"))
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert engine_core.resolve_async_scheduling(create_engine_config(target), UniProcExecutor)
    assert not engine_core.resolve_async_scheduling(
        create_engine_config(target, speculative_config=ngram), UniProcExecutor)
    assert engine_core.resolve_async_scheduling(
        create_engine_config(target, speculative_config=ngram, async_scheduling=True),
        UniProcExecutor)
