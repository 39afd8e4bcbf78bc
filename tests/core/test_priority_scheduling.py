"""Priority scheduling (`scheduling_policy="priority"`, vLLM's): queue order, preemption of
lower-priority running requests, and outputs that the policy never changes.

Built on test_scheduler.py's FakeWorker, whose sampled tokens are a function of the context read
back from its token-id KV cache, so a request preempted and recomputed must give the same tokens.
"""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.request_queue import FCFSRequestQueue, PriorityRequestQueue
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import (BLOCK_SIZE, FakeWorker, assert_all_blocks_free,
                                       run_to_completion, step)


def make_scheduler(policy: str = "priority", num_blocks: int = 64, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                     max_num_seqs=max_num_seqs, scheduling_policy=policy),
                     CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                     max_model_len=256, num_blocks=num_blocks)


def make_request(req_id: str, prompt: list[int], priority: int = 0, max_tokens: int = 8,
                 arrival_time: float = 0.0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(req_id, prompt, params, max_tokens, get_request_block_hasher(BLOCK_SIZE),
                   arrival_time=arrival_time, priority=priority)


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    queue = PriorityRequestQueue()
    for req_id, priority, arrival in [("a", 1, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", -5, 3.0),
                                      ("e", 1, -1.0)]:
        queue.add(make_request(req_id, [1], priority, arrival_time=arrival))
    assert [r.request_id for r in queue] == ["d", "c", "b", "e", "a"]
    queue.remove(next(r for r in queue if r.request_id == "b"))
    assert [queue.pop().request_id for _ in range(len(queue))] == ["d", "c", "e", "a"]


def test_fcfs_queue_puts_preempted_requests_first() -> None:
    queue = FCFSRequestQueue()
    first, second = make_request("a", [1]), make_request("b", [1])
    queue.add(first)
    second.status = second.status.PREEMPTED
    queue.add(second)
    assert [r.request_id for r in queue] == ["b", "a"]


def test_waiting_requests_are_admitted_by_priority() -> None:
    sched, worker = make_scheduler(max_num_seqs=1), FakeWorker()
    for req_id, priority in [("low", 5), ("mid", 1), ("high", -1)]:
        sched.add_request(make_request(req_id, [1, 2, 3], priority, max_tokens=2))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, worker)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order == ["high", "mid", "low"]


def test_high_priority_preempts_a_full_batch_and_outputs_do_not_change() -> None:
    prompts = {f"low{i}": [i + 1] * 6 for i in range(3)}
    reference_sched, reference_worker = make_scheduler("fcfs"), FakeWorker()
    for req_id, prompt in [*prompts.items(), ("urgent", [9, 9, 9])]:
        reference_sched.add_request(make_request(req_id, prompt, max_tokens=12))
    expected = run_to_completion(reference_sched, reference_worker)

    sched, worker = make_scheduler(max_num_seqs=3), FakeWorker()
    for req_id, prompt in prompts.items():
        sched.add_request(make_request(req_id, prompt, priority=10, max_tokens=12))
    step(sched, worker)
    step(sched, worker)
    sched.add_request(make_request("urgent", [9, 9, 9], priority=0, max_tokens=12,
                                   arrival_time=1e9))
    so, outputs = step(sched, worker)
    # The latest of the lowest-priority running requests made room, in the same step.
    assert so.preempted_req_ids == {"low2"}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["urgent"]
    first = {out.request_id: out.new_token_ids for out in outputs}
    results = run_to_completion(sched, worker)
    assert first["urgent"] + results["urgent"][0] == expected["urgent"][0]
    for req_id in prompts:       # recomputed after the preemption: the same tokens
        assert expected[req_id][0][-len(results[req_id][0]):] == results[req_id][0]
    assert_all_blocks_free(sched)


def test_equal_priorities_never_preempt_each_other() -> None:
    sched, worker = make_scheduler(max_num_seqs=2), FakeWorker()
    for i in range(2):
        sched.add_request(make_request(f"r{i}", [i + 1] * 4, priority=3, max_tokens=6))
    step(sched, worker)
    sched.add_request(make_request("late", [7] * 4, priority=3, max_tokens=6, arrival_time=1e9))
    so, _ = step(sched, worker)
    assert not so.preempted_req_ids and not so.scheduled_new_reqs


def test_block_shortage_preempts_the_lowest_priority_request() -> None:
    # 7 usable blocks of 4 tokens: three 8-token prompts fit, their decodes soon do not.
    sched, worker = make_scheduler(num_blocks=8), FakeWorker()
    for req_id, priority in [("vip", 0), ("normal", 1), ("bulk", 9)]:
        sched.add_request(make_request(req_id, [len(req_id)] * 8, priority, max_tokens=8))
    preempted: list[str] = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, worker)
        preempted += sorted(so.preempted_req_ids)
    assert preempted and preempted[0] == "bulk" and "vip" not in preempted
    assert_all_blocks_free(sched)


def test_fcfs_refuses_a_priority() -> None:
    sched = make_scheduler("fcfs")
    with pytest.raises(ValueError, match="priority 2 needs the priority scheduling policy"):
        sched.add_request(make_request("a", [1], priority=2))
    with pytest.raises(ValueError, match="priority"):
        make_scheduler().add_request(make_request("b", [1], priority=1 << 70))
