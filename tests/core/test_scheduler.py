"""Scheduler from plain configs: budgets, chunked prefill, preemption, stops, abort, prefix hits.

`FakeWorker` stands in for the model runner without a model: its "KV cache" stores (position,
token id) per slot, it writes the slots of every scheduled token, then checks that every position a
request attends to holds that request's own token (so a wrong prefix hit, a stale block or a bad
block table is caught), and samples a token that is a function of the context read back from the
cache. Equal outputs across cache sizes and prefix caching on/off are then the engine's self-oracle
(DESIGN.md §6) at the scheduler level.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
VOCAB = 97


def make_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
                   max_model_len: int = 256, caching: bool = True,
                   chunked: bool = True, long_prefill_token_threshold: int = 0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        enable_chunked_prefill=chunked,
                        long_prefill_token_threshold=long_prefill_token_threshold),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
        max_model_len=max_model_len, num_blocks=num_blocks)


def make_request(sched: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 8,
                 eos: tuple[int, ...] = (), **params) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    sp.update_from_generation_config(eos)
    caching = sched.kv_cache_manager.enable_caching
    hasher = get_request_block_hasher(BLOCK_SIZE) if caching else None
    req = Request(req_id, prompt, sp, max_tokens, hasher)
    sched.add_request(req)
    return req


def context_token(context: list[int]) -> int:
    """A deterministic "model": the next token is a hash of the whole context."""
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


class FakeWorker:
    """The worker's side of the boundary with a token-id "KV cache" and no model.

    Args:
        block_size: tokens per block.
        next_token: (req_id, context) -> sampled token; default `context_token`.
    """

    def __init__(self, block_size: int = BLOCK_SIZE,
                 next_token: Callable[[str, list[int]], int] | None = None) -> None:
        self.block_size = block_size
        self.next_token = next_token or (lambda req_id, ctx: context_token(ctx))
        self.kv: dict[int, tuple[int, int]] = {}
        self.block_table: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.num_hit_reads = 0

    def _slot(self, req_id: str, pos: int) -> int:
        block_id = self.block_table[req_id][pos // self.block_size]
        assert block_id != 0, "request reads or writes the null block"
        return block_id * self.block_size + pos % self.block_size

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            for d in (self.block_table, self.tokens, self.num_computed):
                d.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens, "new request the worker already holds"
            self.block_table[new.req_id] = list(new.block_ids[0])
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            self.block_table[req_id].extend(new_blocks[0])
            assert num_computed == self.num_computed[req_id]
        assert set(so.num_scheduled_tokens) == (set(cached.req_ids)
                                                 | {r.req_id for r in so.scheduled_new_reqs})
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        # Like each attention layer: write this step's KV of every request first, then attend.
        for req_id, n in so.num_scheduled_tokens.items():
            start, toks = self.num_computed[req_id], self.tokens[req_id]
            assert n >= 1 and start + n <= len(toks)
            assert len(self.block_table[req_id]) * self.block_size >= start + n
            for pos in range(start, start + n):
                self.kv[self._slot(req_id, pos)] = (pos, toks[pos])
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            n = so.num_scheduled_tokens[req_id]
            start, toks = self.num_computed[req_id], self.tokens[req_id]
            context = []
            for pos in range(start + n):
                stored = self.kv.get(self._slot(req_id, pos))
                assert stored == (pos, toks[pos]), (
                    f"{req_id} position {pos}: cache holds {stored}, expected {(pos, toks[pos])}")
                context.append(stored[1])
            self.num_hit_reads += start
            self.num_computed[req_id] = start + n
            if start + n == len(toks):
                token = self.next_token(req_id, context)
                toks.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)


def step(sched: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, worker.execute(so))


def run_to_completion(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000,
                      on_step: Callable[[SchedulerOutput], None] | None = None
                      ) -> dict[str, list]:
    """Step until idle; returns req_id -> [output tokens of these steps, finish reason,
    stop reason]."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched, worker)
        if on_step:
            on_step(so)
        for out in outs:
            entry = results.setdefault(out.request_id, [[], None, None])
            entry[0].extend(out.new_token_ids)
            if out.finished:
                entry[1], entry[2] = out.finish_reason, out.stop_reason
    else:
        raise AssertionError("scheduler did not finish")
    sched.kv_cache_manager.block_pool.check_invariants()
    return results


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert not sched.kv_cache_manager.req_to_blocks


# ----------------------------------------------------------------------------- budgets
def test_token_budget_and_max_num_seqs_respected():
    sched = make_scheduler(max_num_batched_tokens=20, max_num_seqs=3)
    worker = FakeWorker()
    rng = random.Random(0)
    for i in range(10):
        make_request(sched, f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))],
                     max_tokens=rng.randint(1, 6))

    def check(so: SchedulerOutput) -> None:
        assert 0 < so.total_num_scheduled_tokens <= 20
        assert len(so.num_scheduled_tokens) <= 3
        assert len(sched.running) <= 3

    results = run_to_completion(sched, worker, on_step=check)
    assert len(results) == 10
    assert all(r[1] == "length" for r in results.values())
    assert_all_blocks_free(sched)


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=16)
    worker = FakeWorker()
    make_request(sched, "short", [1, 2, 3], max_tokens=20)
    so, outs = step(sched, worker)
    assert so.num_scheduled_tokens == {"short": 3} and len(outs[0].new_token_ids) == 1
    make_request(sched, "long", list(range(40)), max_tokens=2)
    chunks = []
    while "long" not in {o.request_id for o in outs if o.new_token_ids}:
        so, outs = step(sched, worker)
        # The running decode goes first and takes 1 token; the prompt gets the rest of the budget.
        assert so.num_scheduled_tokens["short"] == 1
        assert so.total_num_scheduled_tokens <= 16
        chunks.append(so.num_scheduled_tokens["long"])
        if sum(chunks) < 40:
            assert chunks[-1] == 15
            # A partial prefill chunk samples nothing.
            assert "long" not in {o.request_id for o in outs}
    assert chunks == [15, 15, 10]
    new_ids = [r.req_id for r in so.scheduled_new_reqs]
    assert new_ids == []  # "long" is a cached (running) request after its first chunk


def test_chunked_prefill_off_waits_for_budget():
    sched = make_scheduler(max_num_batched_tokens=16, chunked=False)
    worker = FakeWorker()
    make_request(sched, "a", list(range(10)), max_tokens=5)
    make_request(sched, "b", list(range(100, 110)), max_tokens=5)
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 10}  # "b" does not fit whole and is not split
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}


def test_long_prefill_token_threshold_caps_a_chunk():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    worker = FakeWorker()
    make_request(sched, "long", list(range(30)), max_tokens=1)
    make_request(sched, "b", [5, 6], max_tokens=1)
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"long": 8, "b": 2}


# ----------------------------------------------------------------------------- preemption
def test_preemption_recomputes_most_recent_request_and_loses_nothing():
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens each grow until they collide,
    # while a third waits for a sequence slot.
    sched = make_scheduler(num_blocks=7, caching=False, max_num_seqs=2)
    worker = FakeWorker()
    a = make_request(sched, "a", list(range(8)), max_tokens=12)
    b = make_request(sched, "b", list(range(50, 58)), max_tokens=12)
    c = make_request(sched, "c", [7, 8, 9], max_tokens=3)
    preempted_at = None
    for i in range(100):
        so, _ = step(sched, worker)
        if so.preempted_req_ids:
            preempted_at = i
            break
    assert preempted_at is not None
    assert so.preempted_req_ids == {"b"}
    assert "b" not in so.num_scheduled_tokens and so.num_scheduled_tokens["a"] == 1
    assert list(sched.waiting) == [b, c] and b.status == RequestStatus.PREEMPTED
    assert sched.running == [a]
    assert b.num_computed_tokens == 0 and b.num_output_tokens > 0
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    kept = list(b.output_token_ids)
    # No waiting request is admitted in a step that preempted.
    assert not so.scheduled_new_reqs
    results = run_to_completion(sched, worker)
    assert b.output_token_ids[:len(kept)] == kept
    # Same tokens as with a cache that never runs out.
    ref_sched = make_scheduler(num_blocks=64, caching=False)
    make_request(ref_sched, "a", list(range(8)), max_tokens=12)
    make_request(ref_sched, "b", list(range(50, 58)), max_tokens=12)
    make_request(ref_sched, "c", [7, 8, 9], max_tokens=3)
    ref = run_to_completion(ref_sched, FakeWorker())
    assert [r.output_token_ids for r in (a, b, c)] == [ref[k][0] for k in "abc"]
    assert len(b.output_token_ids) == 12 and results["b"][1] == "length"
    assert_all_blocks_free(sched)


def test_resumed_request_is_sent_whole_with_its_outputs():
    sched = make_scheduler(num_blocks=7, caching=False)
    worker = FakeWorker()
    make_request(sched, "a", list(range(8)), max_tokens=12)
    b = make_request(sched, "b", list(range(50, 58)), max_tokens=12)
    while not step(sched, worker)[0].preempted_req_ids:
        pass
    while True:
        so = sched.schedule()
        new = {r.req_id: r for r in so.scheduled_new_reqs}
        if "b" in new:
            break
        sched.update_from_output(so, worker.execute(so))
    assert new["b"].output_token_ids == b.output_token_ids
    assert new["b"].num_computed_tokens == 0
    assert so.num_scheduled_tokens["b"] == b.num_tokens


def test_preempted_request_reuses_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=7, caching=True)
    worker = FakeWorker()
    a = make_request(sched, "a", list(range(8)), max_tokens=12)
    b = make_request(sched, "b", list(range(50, 58)), max_tokens=12)
    while not step(sched, worker)[0].preempted_req_ids:
        pass
    # b's freed blocks are still cached: on resumption its first blocks are hits.
    while True:
        so = sched.schedule()
        new = {r.req_id: r for r in so.scheduled_new_reqs}
        sched.update_from_output(so, worker.execute(so))
        if "b" in new:
            break
    assert new["b"].num_computed_tokens > 0
    assert so.num_scheduled_tokens["b"] == b.num_tokens - 1 - new["b"].num_computed_tokens
    run_to_completion(sched, worker)
    ref_sched = make_scheduler(num_blocks=64, caching=False)
    make_request(ref_sched, "a", list(range(8)), max_tokens=12)
    make_request(ref_sched, "b", list(range(50, 58)), max_tokens=12)
    ref = run_to_completion(ref_sched, FakeWorker())
    assert (a.output_token_ids, b.output_token_ids) == (ref["a"][0], ref["b"][0])
    assert_all_blocks_free(sched)


def test_request_larger_than_cache_is_refused():
    sched = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        make_request(sched, "big", list(range(20)), max_tokens=1)
    assert not sched.has_unfinished_requests()


# ----------------------------------------------------------------------------- stop conditions
def scripted(tokens: list[int]) -> FakeWorker:
    it = iter(tokens)
    return FakeWorker(next_token=lambda req_id, ctx: next(it))


def finish(sched: Scheduler, worker: FakeWorker) -> tuple[list[int], str, int | str | None]:
    (result,) = run_to_completion(sched, worker).values()
    return tuple(result)


def test_eos_stops_with_finish_reason_stop():
    sched = make_scheduler()
    make_request(sched, "a", [1, 2, 3], max_tokens=10, eos=(7,))
    assert finish(sched, scripted([3, 3, 7, 3])) == ([3, 3, 7], "stop", None)
    assert_all_blocks_free(sched)
    # The worker is told to drop the finished request at the next step.
    assert "a" in sched.schedule().finished_req_ids


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    make_request(sched, "a", [1, 2, 3], max_tokens=4, eos=(7,), ignore_eos=True)
    assert finish(sched, scripted([7, 7, 7, 7, 7])) == ([7, 7, 7, 7], "length", None)


def test_stop_token_ids_set_stop_reason():
    sched = make_scheduler()
    make_request(sched, "a", [1, 2, 3], max_tokens=10, eos=(7,), stop_token_ids=[5])
    assert finish(sched, scripted([3, 5, 3])) == ([3, 5], "stop", 5)


def test_max_tokens_caps_length():
    sched = make_scheduler()
    make_request(sched, "a", [1, 2, 3], max_tokens=3)
    tokens, reason, stop_reason = finish(sched, FakeWorker())
    assert (len(tokens), reason, stop_reason) == (3, "length", None)


def test_max_model_len_caps_length():
    sched = make_scheduler(max_model_len=12)
    make_request(sched, "a", list(range(10)), max_tokens=100)
    tokens, reason, _ = finish(sched, FakeWorker())
    assert len(tokens) == 2 and reason == "length"


def test_min_tokens_defers_eos_and_stop_tokens():
    sched = make_scheduler()
    make_request(sched, "a", [1, 2, 3], max_tokens=10, eos=(7,), stop_token_ids=[5], min_tokens=3)
    assert finish(sched, scripted([7, 5, 7, 3])) == ([7, 5, 7], "stop", None)
    sched = make_scheduler()
    make_request(sched, "a", [1, 2, 3], max_tokens=10, eos=(7,), stop_token_ids=[5], min_tokens=3)
    assert finish(sched, scripted([5, 7, 5, 3])) == ([5, 7, 5], "stop", 5)


# ----------------------------------------------------------------------------- abort
def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    worker = FakeWorker()
    a = make_request(sched, "a", list(range(9)), max_tokens=10)
    b = make_request(sched, "b", list(range(20, 29)), max_tokens=10)
    step(sched, worker)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() < 63
    sched.finish_requests(["a", "b", "unknown"])
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.total_num_scheduled_tokens == 0
    sched.finish_requests("a")  # already finished: ignored


def test_abort_between_schedule_and_update_drops_the_sample():
    sched = make_scheduler()
    worker = FakeWorker()
    make_request(sched, "a", [1, 2, 3], max_tokens=5)
    so = sched.schedule()
    runner_output = worker.execute(so)
    sched.finish_requests("a")
    assert sched.update_from_output(so, runner_output) == []
    assert_all_blocks_free(sched)


# ----------------------------------------------------------------------------- prefix caching
def test_shared_prefix_schedules_only_the_uncached_suffix():
    sched = make_scheduler(max_num_batched_tokens=256)
    worker = FakeWorker()
    prefix = list(range(40))  # 10 full blocks
    a = make_request(sched, "a", prefix + [90, 91, 92], max_tokens=4)
    so, _ = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    b = make_request(sched, "b", prefix + [80, 81, 82, 83, 84, 85], max_tokens=2)
    so, _ = step(sched, worker)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 40
    assert so.num_scheduled_tokens["b"] == 6
    assert new.block_ids[0][:10] == sched.kv_cache_manager.get_block_ids("a")[0][:10]
    assert sched.requests["b"].num_cached_tokens == 40
    stats = sched.make_stats().prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 43 + 46, 40)
    run_to_completion(sched, worker)
    assert worker.num_hit_reads > 0
    # Same tokens without prefix caching.
    ref_sched = make_scheduler(max_num_batched_tokens=256, caching=False)
    make_request(ref_sched, "a", prefix + [90, 91, 92], max_tokens=4)
    make_request(ref_sched, "b", prefix + [80, 81, 82, 83, 84, 85], max_tokens=2)
    ref = run_to_completion(ref_sched, FakeWorker())
    assert (a.output_token_ids, b.output_token_ids) == (ref["a"][0], ref["b"][0])
    assert sched.kv_cache_manager.block_pool.num_cached_blocks() >= 10


def test_fully_cached_prompt_recomputes_its_last_token():
    sched = make_scheduler(max_num_batched_tokens=256)
    worker = FakeWorker()
    prompt = list(range(40))
    make_request(sched, "a", prompt + [99], max_tokens=1)
    run_to_completion(sched, worker)
    # Prompt = 10 full cached blocks: the last block is recomputed for the last token's logits.
    make_request(sched, "b", prompt, max_tokens=1)
    so, _ = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 36
    assert so.num_scheduled_tokens == {"b": 4}
    # Prompt = 41 tokens whose 40 first are cached: only the last token is computed.
    make_request(sched, "c", prompt + [99], max_tokens=1)
    so, _ = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 40
    assert so.num_scheduled_tokens == {"c": 1}
    run_to_completion(sched, worker)


def test_hit_in_the_same_step_as_the_blocks_are_filled():
    sched = make_scheduler(max_num_batched_tokens=256)
    worker = FakeWorker()
    prefix = list(range(16))
    make_request(sched, "a", prefix + [50], max_tokens=3)
    make_request(sched, "b", prefix + [60], max_tokens=3)
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 17, "b": 1}
    run_to_completion(sched, worker)


def test_reset_prefix_cache_makes_next_request_a_miss():
    sched = make_scheduler()
    worker = FakeWorker()
    make_request(sched, "a", list(range(20)), max_tokens=1)
    run_to_completion(sched, worker)
    assert sched.reset_prefix_cache() == 5
    assert sched.make_stats().prefix_cache_stats.queries == 0
    make_request(sched, "b", list(range(20)), max_tokens=1)
    so, _ = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert sched.make_stats().prefix_cache_stats.hit_rate == 0.0


def test_prefix_caching_off_never_hits():
    sched = make_scheduler(caching=False)
    worker = FakeWorker()
    make_request(sched, "a", list(range(20)), max_tokens=1)
    run_to_completion(sched, worker)
    make_request(sched, "b", list(range(20)), max_tokens=1)
    so, _ = step(sched, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert sched.make_stats().num_cached_blocks == 0


# ----------------------------------------------------------------------------- self-oracle
def random_workload(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice([4, 8, 13, 24]))]
                for _ in range(3)]
    work = []
    for _ in range(16):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        work.append((prompt, rng.randint(1, 12)))
    return work


@pytest.mark.parametrize("seed", range(6))
def test_small_cache_with_prefix_caching_gives_the_same_tokens(seed):
    work = random_workload(seed)
    outputs = {}
    stats = {}
    for name, num_blocks, caching, budget in (("ref", 512, False, 512),
                                              ("small", 14, True, 24),
                                              ("small_nocache", 14, False, 24)):
        sched = make_scheduler(num_blocks=num_blocks, caching=caching,
                               max_num_batched_tokens=budget, max_num_seqs=8)
        for i, (prompt, max_tokens) in enumerate(work):
            make_request(sched, f"r{i}", prompt, max_tokens=max_tokens)
        def check(so: SchedulerOutput, sched=sched, budget=budget) -> None:
            assert so.total_num_scheduled_tokens <= budget
            sched.kv_cache_manager.block_pool.check_invariants()

        res = run_to_completion(sched, FakeWorker(), on_step=check)
        outputs[name] = {k: v[0] for k, v in res.items()}
        stats[name] = sched.make_stats()
        assert_all_blocks_free(sched)
    assert outputs["small"] == outputs["ref"]
    assert outputs["small_nocache"] == outputs["ref"]
    assert stats["small"].num_preemptions > 0
    assert stats["small"].prefix_cache_stats.hits > 0


def test_stats_are_a_snapshot():
    """Regression: make_stats returned the live PrefixCacheStats, so an earlier snapshot changed."""
    sched = make_scheduler()
    worker = FakeWorker()
    make_request(sched, "a", list(range(20)), max_tokens=1)
    run_to_completion(sched, worker)
    before = sched.make_stats()
    make_request(sched, "b", list(range(20)), max_tokens=1)
    run_to_completion(sched, worker)
    after = sched.make_stats()
    assert (before.prefix_cache_stats.requests, before.prefix_cache_stats.hits) == (1, 0)
    assert (after.prefix_cache_stats.requests, after.prefix_cache_stats.hits) == (2, 16)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), num_blocks=st.integers(8, 40), budget=st.integers(8, 64),
       max_num_seqs=st.integers(1, 6), chunked=st.booleans(), threshold=st.sampled_from([0, 5]),
       caching=st.booleans(), abort_every=st.sampled_from([0, 3, 7]))
def test_random_configs_match_reference(seed, num_blocks, budget, max_num_seqs, chunked,
                                        threshold, caching, abort_every):
    """Any budget, cache size, chunking and abort pattern: the requests that are not aborted get
    the reference tokens, every step respects the budgets, and all blocks come back."""
    work = random_workload(seed)
    usable = num_blocks - 1
    work = [(p, m) for p, m in work if -(-(len(p) + m) // BLOCK_SIZE) <= usable]
    if not chunked:
        # As the engine's config requires (max_num_batched_tokens >= max_model_len without
        # chunked prefill): a preempted request resumes by recomputing its prompt and outputs in
        # one step, so the budget must hold a whole request, not only its prompt.
        budget = max(budget, max(len(p) + m for p, m in work))
    sched = make_scheduler(num_blocks=num_blocks, caching=caching, max_num_batched_tokens=budget,
                           max_num_seqs=max_num_seqs, chunked=chunked,
                           long_prefill_token_threshold=threshold)
    ref_sched = make_scheduler(num_blocks=1024, caching=False, max_num_batched_tokens=1024)
    for i, (prompt, max_tokens) in enumerate(work):
        make_request(sched, f"r{i}", prompt, max_tokens=max_tokens)
        make_request(ref_sched, f"r{i}", prompt, max_tokens=max_tokens)
    ref = run_to_completion(ref_sched, FakeWorker())
    worker = FakeWorker()
    aborted: set[str] = set()
    results: dict[str, list[int]] = {}
    for n in itertools.count():
        if not sched.has_unfinished_requests():
            break
        assert n < 5000
        if abort_every and n % abort_every == abort_every - 1:
            victim = sorted(sched.requests)[n % len(sched.requests)]
            sched.finish_requests(victim)
            aborted.add(victim)
        so, outs = step(sched, worker)
        assert so.total_num_scheduled_tokens <= budget
        assert len(so.num_scheduled_tokens) <= max_num_seqs
        if threshold:
            for req_id, k in so.num_scheduled_tokens.items():
                assert k <= max(threshold, 1)
        for out in outs:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        sched.kv_cache_manager.block_pool.check_invariants()
    for req_id, (tokens, _, _) in ref.items():
        if req_id not in aborted:
            assert results[req_id] == tokens, req_id
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("num_lookahead_tokens,num_drafts", [(4, 0), (0, 3), (3, 3)])
def test_drafts_and_lookahead_fit_a_cache_sized_for_the_request(num_lookahead_tokens, num_drafts):
    """Regression: draft tokens and lookahead slots were only capped by max_model_len, so a
    request that `add_request` accepted (prompt + max_tokens fit the cache) could need one block
    more than the whole cache near its end, preempt itself and never be readmitted (a livelock)."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                      CacheConfig(block_size=BLOCK_SIZE), max_model_len=256,
                      num_blocks=5, num_lookahead_tokens=num_lookahead_tokens)
    req = make_request(sched, "a", list(range(8)), max_tokens=8)  # 16 tokens = the 4 blocks
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert so.num_scheduled_tokens, "nothing scheduled: the request can never run again"
        assert req.num_computed_tokens <= 16  # drafts never scheduled past prompt + max_tokens
        done = req.num_computed_tokens >= req.num_tokens
        # Every draft is rejected: one token per step, the worst case for the cache.
        out = ModelRunnerOutput(["a"], {"a": 0}, [[5] if done else []],
                                draft_token_ids={"a": [6] * num_drafts} if done else {})
        sched.update_from_output(so, out)
    assert req.get_finished_reason() == "length" and req.num_output_tokens == 8
    assert sched.num_preemptions == 0
    assert_all_blocks_free(sched)
