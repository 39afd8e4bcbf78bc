"""KV cache groups (core/kv_cache_groups.py): sliding-window blocks freed as requests advance,
prefix hits that every group can serve, capacity accounting over all groups, and a scheduler run
whose fake worker reads each group only inside its window (so a freed block read would show)."""

from __future__ import annotations

import random

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_groups import (KVCacheGroupSpec, cdiv, kv_cache_group_windows,
                                           make_kv_cache_groups, num_blocks_for_budget)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4
W = 8


def make_request(req_id: str, tokens: list[int], max_tokens: int = 64) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sp.update_from_generation_config(())
    return Request(req_id, tokens, sp, max_tokens, get_request_block_hasher(BS))


def hybrid_manager(num_blocks: int = 64, sliding_blocks: int = 64,
                   caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, (KVCacheGroupSpec(None, num_blocks),
                                                    KVCacheGroupSpec(W, sliding_blocks)))


def test_group_windows_and_split():
    assert kv_cache_group_windows([8, None, 8, 16]) == (None, 16, 8)
    assert kv_cache_group_windows([8, 8]) == (8,)
    with pytest.raises(ValueError, match="at least one"):
        kv_cache_group_windows([])
    groups = make_kv_cache_groups(10_000, (None, 8), BS, max_num_seqs=4,
                                  max_num_batched_tokens=16)
    # 4 requests x (cdiv(7, 4) + 2) + 16 / 4 + the null block
    assert groups == (KVCacheGroupSpec(None, 10_000), KVCacheGroupSpec(8, 1 + 4 * 4 + 4))
    assert make_kv_cache_groups(5, (None, 8), BS, 4, 16)[1].num_blocks == 5
    # The budget split: group 0 gets what the capped sliding group leaves.
    n = num_blocks_for_budget(1000 * 10, [10, 30], (None, 8), BS, 4, 16)
    assert n == 1000 - 21 * 3
    assert num_blocks_for_budget(10, [10], (None,), BS, 4, 16) == 1


def test_sliding_blocks_freed_as_decode_proceeds():
    """A long request keeps ~cdiv(W, BS) + 1 live sliding blocks while its full group grows."""
    mgr = hybrid_manager()
    req = make_request("a", list(range(5)))
    assert mgr.allocate_slots(req, 5) is not None
    req.num_computed_tokens = 5
    live = []
    for step in range(60):
        req.append_output_token_ids([step % 7])
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        live.append(mgr.num_live_blocks("a"))
        mgr.check_invariants()
    full, sliding = live[-1]
    assert full == cdiv(req.num_computed_tokens, BS)
    assert max(s for _, s in live) <= cdiv(W, BS) + 1
    assert sliding >= cdiv(W - 1, BS)
    assert mgr.num_window_freed_blocks == full - sliding
    # The freed entries are the null block, the live ones the tail of the table.
    ids = mgr.get_block_ids("a")[1]
    assert ids[:full - sliding] == [0] * (full - sliding) and 0 not in ids[full - sliding:]
    free_before = mgr.get_num_free_blocks()
    mgr.free(req)
    assert mgr.get_num_free_blocks() == free_before + full + sliding
    mgr.check_invariants()


def test_long_prompt_in_chunks_holds_only_the_window():
    mgr = hybrid_manager()
    req = make_request("a", list(range(100)))
    for _ in range(10):
        assert mgr.allocate_slots(req, 10) is not None
        req.num_computed_tokens += 10
        assert mgr.num_live_blocks("a")[1] <= cdiv(W - 1 + 10, BS) + 1
    assert mgr.num_live_blocks("a")[0] == 25


def test_prefix_hit_needs_the_window_blocks_of_every_group():
    mgr = hybrid_manager()
    a = make_request("a", list(range(40)))
    mgr.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    mgr.free(a)
    b = make_request("b", list(range(40)) + [99])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 40
    full, sliding = hits.blocks
    assert len(full) == len(sliding) == 10
    # A query at position 40 reads 33..40: blocks 8, 9 (and position 40 itself, computed now).
    skipped = (40 - W + 1) // BS
    assert all(blk.block_id == 0 for blk in sliding[:skipped])
    assert all(blk.block_id != 0 for blk in sliding[skipped:])
    # Evict sliding block 9 (the last before 40): the longest hit every group serves shrinks
    # to a length whose window is still cached.
    pool = mgr.groups[1].block_pool
    pool._evict(sliding[9])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 36 and len(hits.blocks[0]) == len(hits.blocks[1]) == 9
    assert mgr.allocate_slots(b, 5, hits, n) is not None
    mgr.check_invariants()


def test_allocation_needs_every_group():
    """A sliding group with too few free blocks refuses the allocation; nothing is taken."""
    mgr = hybrid_manager(num_blocks=64, sliding_blocks=4)
    a = make_request("a", list(range(12)))
    assert mgr.allocate_slots(a, 12) is not None   # 3 sliding blocks of 3 usable
    b = make_request("b", list(range(100, 108)))
    free_full = mgr.groups[0].block_pool.get_num_free_blocks()
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.groups[0].block_pool.get_num_free_blocks() == free_full
    assert "b" not in mgr.req_to_blocks


class WindowedFakeWorker:
    """Each group's token-id "KV cache"; a sliding group's reads cover only the window, and a
    stored (position, token) that differs from the request's shows a block freed too early."""

    def __init__(self, windows: tuple[int | None, ...], block_size: int = BS) -> None:
        self.windows = windows
        self.block_size = block_size
        self.kv = [dict() for _ in windows]
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            for d in (self.tables, self.tokens, self.computed):
                d.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            for table, ids in zip(self.tables[req_id], new_blocks):
                table.extend(ids)
        req_ids = list(so.num_scheduled_tokens)
        for req_id in req_ids:
            start, n = self.computed[req_id], so.num_scheduled_tokens[req_id]
            for g in range(len(self.windows)):
                for pos in range(start, start + n):
                    self.kv[g][self._slot(req_id, g, pos)] = (pos, self.tokens[req_id][pos])
        sampled = []
        for req_id in req_ids:
            start, n = self.computed[req_id], so.num_scheduled_tokens[req_id]
            toks = self.tokens[req_id]
            for g, window in enumerate(self.windows):
                for q in range(start, start + n):
                    first = 0 if window is None else max(0, q - window + 1)
                    for pos in range(first, q + 1):
                        got = self.kv[g].get(self._slot(req_id, g, pos))
                        assert got == (pos, toks[pos]), (req_id, g, q, pos, got)
            self.computed[req_id] = start + n
            if start + n == len(toks):
                toks.append(sum(toks[-3:]) % 50)
                sampled.append([toks[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    def _slot(self, req_id: str, g: int, pos: int) -> int:
        block_id = self.tables[req_id][g][pos // self.block_size]
        assert block_id != 0, f"{req_id} group {g} touches the null block at position {pos}"
        return block_id * self.block_size + pos % self.block_size


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_with_sliding_group_reads_correct_kv(seed):
    """Random prompts sharing prefixes, chunked prefill, preemption under a small cache: every
    key a query reads inside its window holds the right token, in both groups."""
    rng = random.Random(seed)
    windows = (None, W)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
                      CacheConfig(block_size=BS, enable_prefix_caching=True),
                      max_model_len=128, num_blocks=40, kv_cache_windows=windows)
    assert [s.sliding_window for s in sched.kv_cache_manager.kv_cache_groups] == [None, W]
    worker = WindowedFakeWorker(windows)
    base = [rng.randrange(50) for _ in range(40)]
    for i in range(10):
        tail = [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        prompt = base[:rng.randrange(1, 40)] + tail
        sched.add_request(make_request(str(i), prompt, max_tokens=rng.randrange(4, 24)))
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.update_from_output(so, worker.execute(so))
        sched.kv_cache_manager.check_invariants()
    assert not sched.has_unfinished_requests()
    mgr = sched.kv_cache_manager
    assert mgr.num_window_freed_blocks > 0
    assert all(g.block_pool.get_num_free_blocks() == g.block_pool.num_blocks - 1
               for g in mgr.groups)


def kv_blocks_in_use(windows: tuple[int | None, ...], layers_per_group: list[int],
                     prompt_len: int, num_output_tokens: int, block_size: int = 16,
                     chunk: int = 2048) -> tuple[int, int]:
    """Drive one request (prompt in `chunk`-token steps, then decodes) through a KVCacheManager
    with these groups; returns (peak, final) layer-blocks in use, i.e. the sum over groups of
    live blocks x layers in the group: the KV memory in units of one layer's block."""
    num_blocks = cdiv(prompt_len + num_output_tokens, block_size) + 2
    mgr = KVCacheManager(num_blocks, block_size, False,
                         tuple(KVCacheGroupSpec(w, num_blocks) for w in windows))
    req = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=num_output_tokens),
                  num_output_tokens)
    peak = 0

    def in_use() -> int:
        return sum(n * k for n, k in zip(mgr.num_live_blocks("r"), layers_per_group))

    while req.num_computed_tokens < prompt_len:
        n = min(chunk, prompt_len - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        peak = max(peak, in_use())
    for _ in range(num_output_tokens):
        req.append_output_token_ids([1])
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        peak = max(peak, in_use())
    return peak, in_use()


def test_memory_saved_on_a_long_prompt(capsys):
    """Gemma-3-1B's layout (26 layers: 4 full attention, 22 with a 512-token window), an
    8192-token prompt in 2048-token chunks and 256 decodes: KV blocks held with window freeing
    against one group that keeps every block."""
    kept_peak, kept_final = kv_blocks_in_use((None,), [26], 8192, 256)
    freed_peak, freed_final = kv_blocks_in_use((None, 512), [4, 22], 8192, 256)
    assert kept_final == 26 * cdiv(8192 + 256, 16)
    # Sliding layers hold at most window + one chunk: 4 x 528 + 22 x (32 + 128 + 1).
    assert freed_peak <= 4 * 528 + 22 * (cdiv(511 + 2048, 16) + 1)
    assert freed_final <= 4 * 528 + 22 * (cdiv(512, 16) + 1)
    with capsys.disabled():
        print(f"\nKV layer-blocks in use, Gemma-3-1B layout, 8192+256 tokens: without freeing "
              f"{kept_final} (peak {kept_peak}), with freeing {freed_final} (peak {freed_peak}); "
              f"{kept_final / freed_final:.1f}x less at the end")
