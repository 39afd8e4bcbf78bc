"""The state cache group (core/state_cache_group_manager.py): one slot per request from its first
allocation to its end, whatever its length; a pool of max_num_seqs slots; no prefix hits for a
hybrid model (mode "none"); the budget counts the slots' bytes; a scheduler run with preemption
keeps every running request in a slot of its own. Mode "align": prefill steps end on block
boundaries, checkpoints are registered one step after the step that writes them and hit at
the longest boundary the attention group also has, a request holds at most 2 slots."""

from __future__ import annotations

import random

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_groups import (STATE_ALIGN_GROUP, STATE_GROUP, KVCacheCapacity,
                                           KVCacheGroupSpec, cdiv, make_kv_cache_groups,
                                           num_blocks_for_budget)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.state_cache_group_manager import align_prefill_tokens
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


def test_align_prefill_tokens_ends_steps_on_block_boundaries():
    # 70 prompt tokens, blocks of 16: last boundary 64.
    assert align_prefill_tokens(70, 70, 0, 40, 16) == 32          # budget 40 -> [0, 32)
    assert align_prefill_tokens(70, 70, 32, 38, 16) == 32         # -> [32, 64)
    assert align_prefill_tokens(70, 70, 64, 6, 16) == 6           # the tail
    assert align_prefill_tokens(70, 70, 0, 70, 16) == 64          # unchunked: [0, 64) [64, 70)
    assert align_prefill_tokens(70, 70, 0, 10, 16) == 10          # under a block: left alone
    assert align_prefill_tokens(64, 64, 0, 64, 16) == 48          # a hit leaves 1 token
    assert align_prefill_tokens(70, 71, 70, 1, 16) == 1           # a decode


def test_align_checkpoints_hit_after_the_writing_step():
    groups = make_kv_cache_groups(64, (None, STATE_ALIGN_GROUP), BS, 2, 16)
    assert groups[1] == KVCacheGroupSpec(None, 5, state=True, align=True)
    mgr = KVCacheManager(64, BS, True, groups)
    a = make_request("a", list(range(10)))
    ids = mgr.allocate_slots(a, 8)                        # [0, 8): writes entry 1
    assert ids[1][0] != 0 and ids[1][1] != 0              # and entry 0, a boundary inside it
    b = make_request("b", list(range(10)))
    assert mgr.get_computed_blocks(b)[1] == 0              # not before the step has run
    a.num_computed_tokens = 8
    ids2 = mgr.allocate_slots(a, 2)                       # [8, 10): reads entry 1, writes 2
    assert len(ids2[1]) == 1 and ids2[1][0] not in ids[1]
    blocks, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and [x.block_id for x in blocks.blocks[1]] == [0, ids[1][1]]
    a.num_computed_tokens = 10
    mgr.free(a)             # the checkpoints outlive the request (s(8), and s(12) is not one)
    e = make_request("e", list(range(4)) + [99, 98, 97, 96, 95])    # shares 1 block: s(4)
    blocks, num_hit = mgr.get_computed_blocks(e)
    assert num_hit == 4 and [x.block_id for x in blocks.blocks[1]] == [ids[1][0]]
    c = make_request("c", list(range(8)) + [99, 98, 97, 96, 95])   # shares 2 blocks, not 3
    blocks, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8
    ids_c = mgr.allocate_slots(c, 5, blocks, num_hit)
    assert ids_c[1][:2] == [0, ids[1][1]] and len(ids_c[1]) == 4     # hit, null, new entry 3
    assert mgr.num_live_blocks("c")[1] == 2
    d = make_request("d", [5] + list(range(1, 12)))       # no shared first block: no hit
    assert mgr.get_computed_blocks(d)[1] == 0
    mgr.check_invariants()


def test_align_scheduler_with_preemption_bounds_slots_per_request():
    rng = random.Random(1)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10),
                      CacheConfig(block_size=BS, enable_prefix_caching=True), 256, 10,
                      kv_cache_windows=(None, STATE_ALIGN_GROUP))
    prefix = [rng.randrange(100) for _ in range(9)]
    for i in range(8):
        sched.add_request(make_request(f"r{i}", prefix + [rng.randrange(100) for _ in range(
            rng.randint(1, 8))], max_tokens=rng.randint(4, 10)))
    state = sched.kv_cache_manager.groups[1]
    finished, num_hit_tokens = 0, 0
    for _ in range(600):
        out = sched.schedule()
        for r in sched.running:
            live = [b for b in state.req_to_blocks[r.request_id] if b.block_id != 0]
            # 2, and the boundaries inside the step just scheduled (when they got slots)
            end = r.num_computed_tokens
            start = end - out.num_scheduled_tokens.get(r.request_id, 0)
            inside = max(0, (end - 1) // BS - -(-start // BS))
            assert 1 <= len(live) <= 2 + inside
        for req in out.scheduled_new_reqs:
            num_hit_tokens += req.num_computed_tokens
            assert req.num_computed_tokens % BS == 0
        for rid, n in out.num_scheduled_tokens.items():
            end = sched.requests[rid].num_computed_tokens    # (this step's tokens included)
            if end < sched.requests[rid].num_prompt_tokens // BS * BS:
                assert end % BS == 0 or n < BS       # prefill chunks end on boundaries
        sampled = [r for r in out.num_scheduled_tokens
                   if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
        runner_out = ModelRunnerOutput(
            req_ids=sampled, req_id_to_index={r: i for i, r in enumerate(sampled)},
            sampled_token_ids=[[1] for _ in sampled])
        finished += sum(1 for o in sched.update_from_output(out, runner_out) if o.finished)
        sched.kv_cache_manager.check_invariants()
        if finished == 8:
            break
    assert finished == 8 and sched.num_preemptions > 0 and num_hit_tokens > 0
    assert not state.req_to_blocks
