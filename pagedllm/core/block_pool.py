"""BlockPool: owns every KV block: reference counts, the LRU free queue and the prefix-cache map.

Invariants (checked by `check_invariants`, exercised by property tests):
- a block is in the free queue iff its `ref_cnt == 0`;
- a block with a `block_hash` is the one entry of `cached_block_hash_to_block` for that hash;
- free + in use == num_blocks - 1: block 0 is the null block, never handed out; its slots are
  zero and serve as the target of padded reads (no garbage enters attention).
A freed block keeps its hash (and stays a prefix-cache hit) until it is popped from the free queue
for reuse: the queue is ordered least recently freed first, so eviction is LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV tensor."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Allocate, share, cache and evict KV blocks.

    Args:
        num_blocks: total number of blocks in the KV cache, the null block included.
        enable_caching: keep hashes of full blocks so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # block_id -> block, least recently freed first.
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of blocks in use by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` free blocks (evicting their cached hashes) with ref_cnt 1.

        Raises:
            ValueError: if fewer blocks are free (callers check first).
        """
        if num_blocks > len(self.free_block_queue):
            raise ValueError(f"cannot get {num_blocks} free blocks, "
                             f"only {len(self.free_block_queue)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits (removing free ones from the free queue). The null
        block (a sliding-window hit's skipped entries) is left alone."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free queue's tail in
        the given order (so the first given is evicted first). The null block is skipped."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their hashes.

        A hash already owned by another block is left to that block (this one stays uncached);
        null entries (blocks a sliding window dropped) are skipped.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is self.null_block:
                continue
            h = block_hashes[i]
            if h not in self.cached_block_hash_to_block:
                block.block_hash = h
                self.cached_block_hash_to_block[h] = block

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these blocks' hashes from the prefix cache (their contents are wrong: a failed
        KV load); the blocks themselves stay with their holders."""
        for block_id in block_ids:
            self._evict(self.blocks[block_id])

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their data); returns how many."""
        n = len(self.cached_block_hash_to_block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return n

    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt {block.ref_cnt}"
            in_free = block.block_id in self.free_block_queue
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id} free/used mismatch"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block
        assert all(b.block_hash is not None for b in self.cached_block_hash_to_block.values())
        assert self.null_block.block_id not in self.free_block_queue
        assert self.null_block.block_hash is None
        num_used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert len(self.free_block_queue) + num_used == self.num_blocks - 1
