"""KVCacheGroupManager: the blocks of every request in one KV cache group (one attention type).

A request's block list is position-aligned: entry j holds positions [j * block_size, (j + 1) *
block_size). For a sliding-window group, entries whose positions left the window of every future
query are freed and replaced by the pool's null block (`remove_skipped_blocks`), and prefix-cache
hits far behind the hit length are the null block from the start:

    window W = 8, block_size = 4, num_computed_tokens = 17 (next query at position 17 reads 10..17)
    blocks:  [null, null, b2, b3, b4]      blocks 0, 1 (positions 0..7) are out of the window

Prefix caching: a block is registered under its hash when it becomes full, before it can leave
the window, so a freed block stays a hit for later requests until the pool evicts it.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, cdiv, num_skipped_blocks


class KVCacheGroupManager:
    """Allocate, free and find cached blocks of one group.

    Args:
        spec: the group's window and block count.
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
    """

    def __init__(self, spec: KVCacheGroupSpec, block_size: int, enable_caching: bool) -> None:
        self.sliding_window = spec.sliding_window
        self.block_size = block_size
        self.block_pool = BlockPool(spec.num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of a request's leading blocks already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Blocks returned to the pool because they left the window (since start).
        self.num_window_freed_blocks = 0

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return num_skipped_blocks(self.sliding_window, num_computed_tokens, self.block_size)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks that no query at a position >= `num_computed_tokens` reads
        (their entries become the null block). A no-op for full attention."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed = []
        null = self.block_pool.null_block
        # Entries are nulled from the front, so the first null met going back ends the walk.
        for j in range(min(self.num_skipped_blocks(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[j] is null:
                break
            removed.append(blocks[j])
            blocks[j] = null
        self.block_pool.free_blocks(removed)
        self.num_window_freed_blocks += len(removed)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock],
                                   num_computed_after_step: int | None = None) -> int:
        """Free blocks an allocation for `num_tokens` slots takes (new blocks, plus hits that
        now sit in the free queue). (`num_computed_after_step`: for a state group's sake.)"""
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_new = max(cdiv(num_tokens, self.block_size) - num_held, 0)
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock],
                 num_computed_after_step: int | None = None) -> list[KVCacheBlock]:
        """Take the hits and enough new blocks for `num_tokens` slots (callers check
        `get_num_blocks_to_allocate` first). Returns the blocks appended (hits first)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if request_id not in self.num_cached_block:
            self.num_cached_block[request_id] = len(new_computed_blocks)
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(
            max(cdiv(num_tokens, self.block_size) - len(blocks), 0))
        blocks.extend(new_blocks)
        return new_computed_blocks + new_blocks

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_full: int) -> None:
        """Register the request's full blocks up to `num_full` in the prefix cache."""
        num_cached = self.num_cached_block.get(request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes,
                                              num_cached, num_full)
            self.num_cached_block[request_id] = num_full

    def find_longest_cache_hit(self, block_hashes: list[bytes],
                               max_num_blocks: int) -> list[KVCacheBlock]:
        """The blocks of the longest hit of at most `max_num_blocks` blocks.

        Full attention: the leading run of cached blocks. Sliding window: the largest e such
        that the blocks a query at position e * block_size reads (those from
        `num_skipped_blocks(e * block_size)` to e - 1) are all cached; the skipped entries are the
        null block. (vLLM's sliding-window manager searches the same way, from the right.)
        """
        pool = self.block_pool
        if self.sliding_window is None:
            hits = []
            for block_hash in block_hashes[:max_num_blocks]:
                block = pool.get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)
            return hits
        cached = [pool.get_cached_block(h) for h in block_hashes[:max_num_blocks]]
        run, best = 0, 0    # run: cached blocks ending at e - 1
        for e in range(1, len(cached) + 1):
            run = run + 1 if cached[e - 1] is not None else 0
            if run >= e - self.num_skipped_blocks(e * self.block_size):
                best = e
        skipped = self.num_skipped_blocks(best * self.block_size)
        return [pool.null_block] * skipped + cached[skipped:best]

    def free(self, request_id: str, block_hashes: list[bytes] | None = None,
             num_computed_tokens: int | None = None) -> None:
        """Release the request's blocks; its tail blocks become the first eviction candidates.
        (`block_hashes`, `num_computed_tokens`: for a state group's sake.)"""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds (null entries excluded)."""
        null = self.block_pool.null_block
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not null)
