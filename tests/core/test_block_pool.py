"""BlockPool and KVCacheManager invariants: ref counts, accounting, LRU eviction, prefix hits.

A hypothesis state machine drives a KVCacheManager the way the scheduler does (admit with prefix
hits, grow by decode tokens, free, reset) and checks, after every step, the pool against an
independent model: which requests hold which blocks, when each block was last freed (LRU order) and
which hashes must still be hits. Plain tests pin down the individual rules.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(req_id: str, tokens: list[int], caching: bool = True) -> Request:
    hasher = get_request_block_hasher(BLOCK_SIZE) if caching else None
    return Request(req_id, tokens, SamplingParams(max_tokens=64), max_tokens=64,
                   block_hasher=hasher)


# ----------------------------------------------------------------------------- BlockPool rules
def test_null_block_is_never_handed_out():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4
    pool.check_invariants()


def test_pool_needs_a_real_block():
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=False)


def test_double_free_is_an_error():
    pool = BlockPool(3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    hashes = [bytes([i]) * 32 for i in range(5)]
    pool.cache_full_blocks(blocks, hashes, 0, 5)
    # Free in the order 3, 1, 4, 0, 2 (ids 4, 2, 5, 1, 3).
    order = [blocks[i] for i in (3, 1, 4, 0, 2)]
    for block in order:
        pool.free_blocks([block])
    for expected in order:
        (got,) = pool.get_new_blocks(1)
        assert got is expected
        assert got.block_hash is None
        pool.check_invariants()


def test_freed_cached_block_stays_a_hit_until_evicted():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b], [b"A" * 32, b"B" * 32], 0, 2)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(b"A" * 32) is a
    assert pool.get_cached_block(b"B" * 32) is b
    # A hit taken from the free queue leaves the queue, and comes back to its tail on free.
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([a])
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is b
    assert pool.get_cached_block(b"B" * 32) is None
    assert pool.get_cached_block(b"A" * 32) is a
    pool.free_blocks([c])
    pool.check_invariants()


def test_duplicate_hash_keeps_first_owner():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"X" * 32], 0, 1)
    pool.cache_full_blocks([b], [b"X" * 32], 0, 1)
    assert pool.get_cached_block(b"X" * 32) is a and b.block_hash is None
    pool.check_invariants()


def test_no_caching_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"X" * 32, b"Y" * 32], 0, 2)
    assert pool.num_cached_blocks() == 0


# ----------------------------------------------------------------------------- manager rules
def test_manager_frees_tail_blocks_first():
    """A finished request's last block is evicted before its first (its prefix is worth more)."""
    mgr = KVCacheManager(8, BLOCK_SIZE, enable_caching=True)
    req = make_request("a", list(range(12)))
    (ids,) = mgr.allocate_slots(req, 12)
    assert len(ids) == 3
    req.num_computed_tokens = 12
    mgr.free(req)
    got = [b.block_id for b in mgr.block_pool.get_new_blocks(7)]
    # The four never-used blocks come first, then the request's blocks tail first.
    assert got[-3:] == ids[::-1]


def test_manager_prefix_hit_and_last_token_recomputed():
    mgr = KVCacheManager(10, BLOCK_SIZE, enable_caching=True)
    a = make_request("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    mgr.free(a)
    # Same 8 tokens: only the first block can be a hit (the last token must be recomputed).
    b = make_request("b", list(range(8)))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 4 and len(hits.blocks[0]) == 1
    # 9 tokens with the same first 8: both blocks hit.
    c = make_request("c", list(range(9)))
    hits, n = mgr.get_computed_blocks(c)
    assert n == 8
    (new_ids,) = mgr.allocate_slots(c, 1, hits, n)
    assert new_ids[:2] == [h.block_id for h in hits.blocks[0]] and len(new_ids) == 3
    assert all(h.ref_cnt == 1 for h in hits.blocks[0])
    mgr.block_pool.check_invariants()


def test_manager_allocation_failure_changes_nothing():
    mgr = KVCacheManager(4, BLOCK_SIZE, enable_caching=True)
    a = make_request("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    mgr.free(a)
    b = make_request("b", list(range(8)) + list(range(100, 110)))  # needs 5 blocks, 3 exist
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    before = ([blk.ref_cnt for blk in mgr.block_pool.blocks], list(mgr.block_pool.free_block_queue),
              dict(mgr.block_pool.cached_block_hash_to_block))
    assert mgr.allocate_slots(b, 10, hits, n) is None
    after = ([blk.ref_cnt for blk in mgr.block_pool.blocks], list(mgr.block_pool.free_block_queue),
             dict(mgr.block_pool.cached_block_hash_to_block))
    assert before == after
    assert "b" not in mgr.req_to_blocks


def test_reset_prefix_cache_forgets_hits_and_stats():
    mgr = KVCacheManager(6, BLOCK_SIZE, enable_caching=True)
    a = make_request("a", list(range(9)))
    mgr.allocate_slots(a, 9)
    mgr.record_prefix_lookup(9, 0)
    a.num_computed_tokens = 9
    mgr.free(a)
    assert mgr.reset_prefix_cache() == 2
    assert mgr.prefix_cache_stats.queries == 0
    hits, n = mgr.get_computed_blocks(make_request("b", list(range(9))))
    assert hits.blocks == ([],) and n == 0
    mgr.block_pool.check_invariants()


# ----------------------------------------------------------------------------- state machine
# A small alphabet and few lengths make shared prefixes (and so hits) common.
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=4 * BLOCK_SIZE + 2)


class KVCacheMachine(RuleBasedStateMachine):
    """Random admit / decode / free / reset traffic against a small KVCacheManager."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()

    @initialize(num_blocks=st.integers(2, 12), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.caching = caching
        self.mgr = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching)
        self.pool = self.mgr.block_pool
        self.running: dict[str, Request] = {}
        # Model of the LRU queue: block_id -> a counter value taken when it was last freed.
        self.clock = itertools.count()
        self.freed_at = {i: next(self.clock) for i in range(1, num_blocks)}
        # Model of the prefix cache: hash -> block id; hashes leave only by eviction or reset.
        self.model_cache: dict[bytes, int] = {}

    # -- helpers
    def _free_ids_oldest_first(self) -> list[int]:
        free = [b.block_id for b in self.pool.blocks[1:] if b.ref_cnt == 0]
        return sorted(free, key=self.freed_at.__getitem__)

    def _allocate(self, req: Request, num_new_tokens: int, hits, num_hit_tokens: int) -> bool:
        handle = KVCacheBlocks((hits,))
        hit_ids = {b.block_id for b in hits}
        lru = [i for i in self._free_ids_oldest_first() if i not in hit_ids]
        old_hash = {b.block_id: b.block_hash for b in self.pool.blocks}
        held_before = len(self.mgr.req_to_blocks.get(req.request_id, []))
        new_ids = self.mgr.allocate_slots(req, num_new_tokens, handle, num_hit_tokens)
        if new_ids is None:
            needed = -(-(req.num_computed_tokens + num_hit_tokens + num_new_tokens) // BLOCK_SIZE)
            assert needed - held_before - len(hits) > len(lru), "refused although blocks were free"
            return False
        (new_ids,) = new_ids
        assert new_ids[:len(hits)] == [b.block_id for b in hits]
        fresh = new_ids[len(hits):]
        # LRU: the fresh blocks are exactly the least recently freed ones, in that order.
        assert fresh == lru[:len(fresh)]
        for block_id in fresh:
            h = old_hash[block_id]
            if h is not None:
                assert self.model_cache.pop(h) == block_id
        for block in self.mgr.req_to_blocks[req.request_id]:
            if block.block_hash is not None:
                self.model_cache.setdefault(block.block_hash, block.block_id)
        return True

    # -- rules
    @rule(tokens=prompts)
    def admit(self, tokens: list[int]) -> None:
        req = make_request(f"r{next(self.ids)}", tokens, self.caching)
        handle, num_hit_tokens = self.mgr.get_computed_blocks(req)
        (hits,) = handle.blocks
        # Expected hits from the model: the leading hashes still cached, last token excluded.
        expected = 0
        if self.caching:
            for h in req.block_hashes[:(req.num_tokens - 1) // BLOCK_SIZE]:
                if h not in self.model_cache:
                    break
                expected += 1
        assert num_hit_tokens == expected * BLOCK_SIZE
        assert [b.block_id for b in hits] == [self.model_cache[h]
                                              for h in req.block_hashes[:expected]]
        num_new = req.num_tokens - num_hit_tokens
        if self._allocate(req, num_new, hits, num_hit_tokens):
            req.num_computed_tokens = req.num_tokens
            self.running[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data, token: int) -> None:
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        req.append_output_token_ids([token])
        if self._allocate(req, 1, [], 0):
            req.num_computed_tokens += 1
        else:
            # What the scheduler does when a decode does not fit: preempt (free) the request.
            self._free(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data) -> None:
        self._free(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    def _free(self, req: Request) -> None:
        blocks = list(self.mgr.req_to_blocks.get(req.request_id, []))
        self.mgr.free(req)
        del self.running[req.request_id]
        for block in reversed(blocks):
            if block.ref_cnt == 0:
                self.freed_at[block.block_id] = next(self.clock)

    @rule()
    def reset(self) -> None:
        assert self.mgr.reset_prefix_cache() == len(self.model_cache)
        self.model_cache.clear()

    # -- invariants
    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.pool.check_invariants()
        null = self.pool.null_block
        assert null.ref_cnt == 1 and 0 not in self.pool.free_block_queue
        holders = {b.block_id: 0 for b in self.pool.blocks}
        for req_id, blocks in self.mgr.req_to_blocks.items():
            assert req_id in self.running
            assert len({b.block_id for b in blocks}) == len(blocks)
            for b in blocks:
                holders[b.block_id] += 1
        assert holders[0] == 0, "null block handed to a request"
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id] >= 0
        used = sum(1 for b in self.pool.blocks[1:] if b.ref_cnt > 0)
        assert used + self.pool.get_num_free_blocks() == self.pool.num_blocks - 1
        # The free queue holds exactly the unreferenced blocks, least recently freed first.
        assert list(self.pool.free_block_queue) == self._free_ids_oldest_first()

    @invariant()
    def cache_matches_model(self) -> None:
        if not hasattr(self, "mgr"):
            return
        assert {h: b.block_id for h, b in self.pool.cached_block_hash_to_block.items()} == \
            self.model_cache
        if not self.caching:
            assert not self.model_cache
        # A cached block of a running request holds exactly that request's tokens.
        for req_id, blocks in self.mgr.req_to_blocks.items():
            req = self.running[req_id]
            assert len(blocks) == -(-req.num_computed_tokens // BLOCK_SIZE)
            for i, block in enumerate(blocks):
                if block.block_hash is not None:
                    assert block.block_hash == req.block_hashes[i]


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheMachine = KVCacheMachine.TestCase
