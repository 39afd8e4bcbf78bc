"""The state cache group (core/state_cache_group_manager.py): one slot per request from its first
allocation to its end, whatever its length; a pool of max_num_seqs slots; no prefix hits for a
hybrid model (mode "none"); the budget counts the slots' bytes; a scheduler run with preemption
keeps every running request in a slot of its own."""

from __future__ import annotations

import random

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_groups import (STATE_GROUP, KVCacheCapacity, KVCacheGroupSpec, cdiv,
                                           make_kv_cache_groups, num_blocks_for_budget)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int], max_tokens: int = 16) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sp.update_from_generation_config(())
    return Request(req_id, tokens, sp, max_tokens, get_request_block_hasher(BS))


def test_groups_budget_and_capacity():
    groups = make_kv_cache_groups(100, (None, STATE_GROUP), BS, max_num_seqs=3,
                                  max_num_batched_tokens=16)
    assert groups == (KVCacheGroupSpec(None, 100), KVCacheGroupSpec(None, 4, state=True))
    # 4 slots of 1000 bytes come off the budget before group 0's blocks of 10 bytes.
    assert num_blocks_for_budget(10_000, [10, 1000], (None, STATE_GROUP), BS, 3, 16) == 600
    capacity = KVCacheCapacity(groups, BS, max_model_len=1000, max_num_scheduled_tokens=16)
    assert capacity.max_num_blocks(300, 50) == (cdiv(349, BS), 1)


def test_one_slot_per_request_and_no_prefix_hits():
    mgr = KVCacheManager(64, BS, True, make_kv_cache_groups(64, (None, STATE_GROUP), BS, 2, 16))
    a = make_request("a", list(range(20)))
    ids = mgr.allocate_slots(a, 12)
    assert len(ids[0]) == 3 and len(ids[1]) == 1
    a.num_computed_tokens = 12
    assert mgr.allocate_slots(a, 8)[1] == []            # the slot is kept, nothing new
    a.num_computed_tokens = 20
    b = make_request("b", list(range(20)) + [7])        # a's prompt is a cached prefix
    blocks, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 0 and all(not g for g in blocks.blocks)
    assert mgr.allocate_slots(b, 21)[1] != ids[1]
    c = make_request("c", [1, 2])
    assert mgr.allocate_slots(c, 2) is None               # two slots, both taken
    mgr.free(a)
    assert mgr.allocate_slots(c, 2)[1] == ids[1]
    mgr.check_invariants()


def test_scheduler_with_preemption_keeps_distinct_slots():
    rng = random.Random(0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=12),
                      CacheConfig(block_size=BS, enable_prefix_caching=True), 256, 12,
                      kv_cache_windows=(None, STATE_GROUP))
    for i in range(6):
        sched.add_request(make_request(f"r{i}", [rng.randrange(100) for _ in range(
            rng.randint(3, 15))], max_tokens=rng.randint(4, 10)))
    state = sched.kv_cache_manager.groups[1]
    finished = 0
    for _ in range(400):
        out = sched.schedule()
        slots = [state.req_to_blocks[r.request_id][0].block_id for r in sched.running]
        assert len(set(slots)) == len(slots) and 0 not in slots
        for req in out.scheduled_new_reqs:      # a (re)started request brings its slot
            assert len(req.block_ids[1]) == 1 and req.num_computed_tokens == 0
        sampled = [r for r in out.num_scheduled_tokens
                   if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
        runner_out = ModelRunnerOutput(
            req_ids=sampled, req_id_to_index={r: i for i, r in enumerate(sampled)},
            sampled_token_ids=[[1] for _ in sampled])
        finished += sum(1 for o in sched.update_from_output(out, runner_out) if o.finished)
        if finished == 6:
            break
    assert finished == 6 and sched.num_preemptions > 0
    assert not state.req_to_blocks and state.block_pool.get_num_free_blocks() == 3
