"""Admission prices every KV cache group as the scheduler holds it (`KVCacheCapacity`,
core/kv_cache_groups.py), over random windows (full attention, one sliding group, full + sliding),
block sizes, step budgets, chunked prefill on and off, prompt lengths and max_tokens:

- the price is exactly the most blocks the request holds in any state the scheduler reaches
  (measured by driving the real KVCacheManager through those states, below);
- a request it admits completes alone on a cache of that size without preempting itself, every
  read inside its window finding the right token (so the freed blocks were truly out of it), and
  several admitted requests competing for the cache all complete with their lone tokens;
- a request it refuses holds more blocks than some group has in one of those states;
- the front end's gate (`InputProcessor`) refuses exactly what `Scheduler.add_request` refuses.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, cdiv
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.sampling_params import SamplingParams
from tests.core.test_hybrid_kv_cache import WindowedFakeWorker

MAX_MODEL_LEN = 64
VOCAB = 50
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


@st.composite
def engine_shapes(draw) -> dict:
    """A cache and scheduler: windows, block size, step budget (chunked prefill on: any; off: the
    config's rule, at least max_model_len), long-prefill threshold, pool size, prefix caching."""
    window = draw(st.integers(1, 12))
    windows = draw(st.sampled_from([(None,), (window,), (None, window)]))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 24)) if chunked else MAX_MODEL_LEN
    threshold = draw(st.sampled_from([0, 0, draw(st.integers(1, budget))])) if chunked else 0
    return dict(windows=windows, block_size=draw(st.sampled_from([1, 2, 4, 8])), chunked=chunked,
                max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                num_blocks=draw(st.integers(2, 40)), caching=draw(st.booleans()))


def make_scheduler(shape: dict, num_blocks: int | None = None,
                   max_model_len: int = MAX_MODEL_LEN) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=shape["max_num_batched_tokens"], max_num_seqs=4,
                        enable_chunked_prefill=shape["chunked"],
                        long_prefill_token_threshold=shape["long_prefill_token_threshold"]),
        CacheConfig(block_size=shape["block_size"], enable_prefix_caching=shape["caching"]),
        max_model_len=max_model_len, num_blocks=num_blocks or shape["num_blocks"],
        kv_cache_windows=shape["windows"])


def make_request(req_id: str, prompt: list[int], max_tokens: int, block_size: int) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sp.update_from_generation_config(())
    return Request(req_id, prompt, sp, max_tokens, get_request_block_hasher(block_size))


def effective_max_tokens(num_prompt_tokens: int, max_tokens: int) -> int:
    """max_tokens as the InputProcessor passes it on (capped by the room left in the context)."""
    return min(max_tokens, max(1, MAX_MODEL_LEN - num_prompt_tokens))


def run(sched: Scheduler, worker: WindowedFakeWorker, max_steps: int = 3000) -> dict:
    """Step until done; returns per request (output tokens, finish reason), the most slots any
    request had and the most blocks any request held in each group."""
    mgr = sched.kv_cache_manager
    live = {r.request_id: r for r in list(sched.waiting) + sched.running}
    most_slots, peak = 0, [0] * len(mgr.groups)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert so.total_num_scheduled_tokens > 0, "nothing scheduled: the cache deadlocked"
        for req_id in so.num_scheduled_tokens:
            most_slots = max(most_slots, sched.requests[req_id].num_computed_tokens)
            peak = [max(p, n) for p, n in zip(peak, mgr.num_live_blocks(req_id))]
        sched.update_from_output(so, worker.execute(so))
        mgr.check_invariants()
    assert not sched.has_unfinished_requests(), "requests never finished"
    assert all(g.block_pool.get_num_free_blocks() == g.block_pool.num_blocks - 1
               for g in mgr.groups)
    return {"outputs": {rid: (r.output_token_ids, r.get_finished_reason())
                        for rid, r in live.items()},
            "most_slots": most_slots, "peak": tuple(peak)}


def _steps(num_tokens: int, step: int) -> list[int]:
    return [min(step, num_tokens - i) for i in range(0, num_tokens, step)]


def reachable_peak(shape: dict, num_prompt_tokens: int, num_slots: int) -> tuple[int, ...]:
    """Most blocks one request holds per group over the states the scheduler reaches with it,
    each driven through a KVCacheManager on an ample pool: its prompt of P' tokens (P' = the
    prompt, or `num_slots` for a recompute after a preemption at its last step) in steps of
    at most the step limit, the first ones shortened to end at any offset c0 (another request
    took the rest of those steps' budget) or, without chunked prefill, in one step; then one token
    per step up to `num_slots`."""
    bs, windows = shape["block_size"], shape["windows"]
    step = shape["long_prefill_token_threshold"] or shape["max_num_batched_tokens"]
    num_blocks = cdiv(MAX_MODEL_LEN, bs) + 2
    widest = max((w for w in windows if w is not None), default=0)
    peak = [0] * len(windows)
    for prompt_len in {num_prompt_tokens, num_slots}:
        offsets = range(0, min(prompt_len, widest + 2 * bs)) if shape["chunked"] else (0,)
        for c0 in offsets:
            schedule = (_steps(c0, step) + _steps(prompt_len - c0, step) if shape["chunked"]
                        else [prompt_len])
            mgr = KVCacheManager(num_blocks, bs, False,
                                 tuple(KVCacheGroupSpec(w, num_blocks) for w in windows))
            req = make_request("r", list(range(prompt_len)), MAX_MODEL_LEN, bs)
            for n in schedule + [1] * (num_slots - prompt_len):
                if req.num_computed_tokens == req.num_tokens:
                    req.append_output_token_ids([1])
                assert mgr.allocate_slots(req, n) is not None
                req.num_computed_tokens += n
                peak = [max(p, k) for p, k in zip(peak, mgr.num_live_blocks("r"))]
    return tuple(peak)


@settings(max_examples=400, **_SETTINGS)
@given(shape=engine_shapes(), num_prompt_tokens=st.integers(1, MAX_MODEL_LEN),
       max_tokens=st.integers(1, 40))
def test_admitted_requests_complete_and_refused_ones_cannot_fit(shape, num_prompt_tokens,
                                                                 max_tokens):
    bs = shape["block_size"]
    max_tokens = effective_max_tokens(num_prompt_tokens, max_tokens)
    prompt = [(7 * i + 3) % VOCAB for i in range(num_prompt_tokens)]
    sched = make_scheduler(shape)
    capacity = sched.kv_cache_capacity
    gate = InputProcessor(None, MAX_MODEL_LEN, VOCAB, (), kv_cache_capacity=capacity)
    try:
        sched.add_request(make_request("r", prompt, max_tokens, bs))
        admitted = True
    except ValueError as e:
        assert "KV blocks" in str(e)
        admitted = False
    try:
        core_req, _ = gate.process("r", prompt, SamplingParams(temperature=0.0,
                                                               max_tokens=max_tokens))
        assert admitted and core_req.max_tokens == max_tokens
    except ValueError as e:
        assert not admitted and str(e).startswith("max_tokens: "), e

    # The request alone on an ample cache: the slots it takes and the states it can reach.
    ample = make_scheduler(shape, num_blocks=cdiv(MAX_MODEL_LEN, bs) + 2)
    ample.add_request(make_request("r", prompt, max_tokens, bs))
    alone = run(ample, WindowedFakeWorker(shape["windows"], bs))
    assert alone["outputs"]["r"][1] == "length"
    assert alone["most_slots"] == capacity.max_num_slots(num_prompt_tokens, max_tokens)
    peak = reachable_peak(shape, num_prompt_tokens, alone["most_slots"])
    assert peak == capacity.max_num_blocks(num_prompt_tokens, max_tokens)
    usable = [g.num_blocks - 1 for g in sched.kv_cache_manager.kv_cache_groups]
    event("admitted" if admitted else "refused")
    if not admitted:
        assert any(p > u for p, u in zip(peak, usable)), (peak, usable)
        return
    got = run(sched, WindowedFakeWorker(shape["windows"], bs))
    assert sched.num_preemptions == 0
    assert got["outputs"] == alone["outputs"]
    assert all(p <= u for p, u in zip(got["peak"], usable))


@settings(max_examples=150, **_SETTINGS)
@given(shape=engine_shapes(), data=st.data())
def test_admitted_requests_competing_for_the_cache_all_complete(shape, data):
    """Up to four requests sharing prefixes, each admitted: chunks of any offset, prefix hits and
    preemptions (the cache fits each alone, not all together) never leave one unfinished."""
    bs = shape["block_size"]
    base = [(5 * i + 1) % VOCAB for i in range(MAX_MODEL_LEN)]
    sched = make_scheduler(shape)
    requests = []
    for i in range(data.draw(st.integers(1, 4))):
        prompt = (base[:data.draw(st.integers(0, 40))]
                  + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)))
        prompt = prompt[:MAX_MODEL_LEN]
        max_tokens = effective_max_tokens(len(prompt), data.draw(st.integers(1, 24)))
        request = make_request(str(i), prompt, max_tokens, bs)
        try:
            sched.add_request(request)
        except ValueError:
            continue
        requests.append((str(i), prompt, max_tokens))
    got = run(sched, WindowedFakeWorker(shape["windows"], bs))
    for req_id, prompt, max_tokens in requests:
        ample = make_scheduler(shape, num_blocks=cdiv(MAX_MODEL_LEN, bs) + 2)
        ample.add_request(make_request(req_id, prompt, max_tokens, bs))
        alone = run(ample, WindowedFakeWorker(shape["windows"], bs))
        assert got["outputs"][req_id] == alone["outputs"][req_id]


def test_sliding_window_priced_at_window_plus_one_step():
    """Regression (issue #5's example): window 8 on every layer, blocks of 4, a 72-token cache
    (18 blocks): a 75-token prompt with max_tokens 24 was priced at 99 tokens of full attention.
    In 16-token steps it holds at most cdiv(8 + 4 - 2 + 16, 4) = 7 blocks; in one 75-token step
    (2048-token steps) it holds 19 and is refused, naming the step budget."""
    shape = dict(windows=(8,), block_size=4, chunked=True, max_num_batched_tokens=16,
                 long_prefill_token_threshold=0, num_blocks=19, caching=True)
    sched = make_scheduler(shape, max_model_len=1024)
    assert sched.kv_cache_capacity.max_num_blocks(75, 24) == (7,)
    prompt = [(7 * i + 3) % VOCAB for i in range(75)]
    sched.add_request(make_request("r", prompt, 24, 4))
    got = run(sched, WindowedFakeWorker((8,), 4))
    assert got["outputs"]["r"][1] == "length" and len(got["outputs"]["r"][0]) == 24
    assert sched.num_preemptions == 0 and got["peak"][0] <= 7
    wide = make_scheduler(dict(shape, max_num_batched_tokens=2048), max_model_len=1024)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        wide.add_request(make_request("r", prompt, 24, 4))


def test_slots_include_the_last_token_only_when_a_step_can_compute_it():
    """Synchronous steps never feed back the last sampled token; async scheduling (its step after
    the last), drafts and lookahead slots can compute its position."""
    config, cache = SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4)

    def slots(**kwargs) -> int:
        sched = Scheduler(config, cache, max_model_len=256, num_blocks=64, **kwargs)
        return sched.kv_cache_capacity.max_num_slots(10, 6)

    assert slots() == 15
    assert slots(async_scheduling=True) == slots(num_speculative_tokens=2) == 16
    assert slots(num_lookahead_tokens=2) == 16
    sched = Scheduler(config, cache, max_model_len=10, num_blocks=64)
    assert sched.kv_cache_capacity.max_num_slots(10, 1) == 10  # the prompt is always computed
