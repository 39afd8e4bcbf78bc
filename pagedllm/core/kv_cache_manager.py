"""KVCacheManager: per-request blocks of every KV cache group, with prefix-cache lookup.

The scheduler talks to this class only: `get_computed_blocks` (prefix hits for a new request),
`allocate_slots` (blocks for the tokens scheduled this step, or None when the cache is full) and
`free`. Blocks travel in a `KVCacheBlocks` handle the scheduler passes on unopened; block ids cross
to the worker as plain ints, one list per group (see core/kv_cache_groups.py for the groups and
their memory). A model with one attention type has one group, and this is a plain paged manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_group_manager import KVCacheGroupManager
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec
from pagedllm.core.request import Request
from pagedllm.core.state_cache_group_manager import (AlignedStateCacheGroupManager,
                                                     StateCacheGroupManager)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start or the last reset, in tokens."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks of one request, one list per KV cache group (an opaque handle for the scheduler)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)


class KVCacheManager:
    """Map requests to KV blocks in every group.

    Args:
        num_blocks: blocks of group 0 (the null block included).
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        kv_cache_groups: the groups (`make_kv_cache_groups`); empty = one full-attention group of
            `num_blocks` blocks.

    Raises:
        ValueError: if `kv_cache_groups[0].num_blocks != num_blocks`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 kv_cache_groups: Sequence[KVCacheGroupSpec] = ()) -> None:
        specs = tuple(kv_cache_groups) or (KVCacheGroupSpec(None, num_blocks),)
        if specs[0].num_blocks != num_blocks:
            raise ValueError(f"group 0 has {specs[0].num_blocks} blocks, num_blocks is "
                             f"{num_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_cache_groups = specs
        self.groups = [(AlignedStateCacheGroupManager if spec.align else StateCacheGroupManager
                        if spec.state else KVCacheGroupManager)(spec, block_size, enable_caching)
                       for spec in specs]
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def block_pool(self) -> BlockPool:
        """Group 0's pool (the only one for a model with one attention type)."""
        return self.groups[0].block_pool

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's blocks of each request."""
        return self.groups[0].req_to_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_window_freed_blocks(self) -> int:
        """Blocks returned to the pools because they left a sliding window (since start)."""
        return sum(g.num_window_freed_blocks for g in self.groups)

    def usage(self) -> float:
        """Fraction of usable blocks in use, over all groups."""
        usable = sum(g.block_pool.num_blocks - 1 for g in self.groups)
        free = sum(g.block_pool.get_num_free_blocks() for g in self.groups)
        return 1.0 - free / usable

    def get_num_free_blocks(self) -> int:
        return sum(g.block_pool.get_num_free_blocks() for g in self.groups)

    def num_cached_blocks(self) -> int:
        return sum(g.block_pool.num_cached_blocks() for g in self.groups)

    def slots_fit(self, slots: Sequence[tuple[str, int]]) -> bool:
        """Whether growing each held request `request_id` to `num_tokens` slots, all of them
        together, finds enough free blocks in every group (what `allocate_slots` would take,
        without the blocks a sliding window frees first)."""
        return all(sum(g.get_num_blocks_to_allocate(rid, n, []) for rid, n in slots)
                   <= g.block_pool.get_num_free_blocks() for g in self.groups)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest prefix of the request's tokens whose KV every group has cached.

        At most `num_tokens - 1` tokens count as hits: the last token is always recomputed so that
        its logits exist. A request that wants prompt logprobs gets no hits (the logprobs of
        cached positions were never computed), though its blocks are still cached for others.
        A hit of L tokens needs, in a full-attention group, every block before L, and in a
        sliding group the blocks the query at position L reads; the hit length shrinks until all
        groups agree. Returns (blocks, num_computed_tokens).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self._empty_blocks(), 0
        num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = [[] for _ in self.groups]
        while True:
            for g, group in enumerate(self.groups):
                hits[g] = group.find_longest_cache_hit(request.block_hashes, num_hit_blocks)
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                break
            # A sliding group's hit at a shorter length may need other blocks: search again.
            num_hit_blocks = shortest
        return KVCacheBlocks(tuple(hits)), shortest * self.block_size

    def _empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.groups))

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (in tokens)."""
        if self.enable_caching:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> tuple[list[int], ...] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones, in every group.

        First each sliding group frees the blocks no query of this step or later reads (they
        lie before the window of the first new token); then, only if every group has enough
        free blocks, hits are taken and new blocks appended.

        Args:
            request: the request (its `num_computed_tokens` is the tokens already in its blocks).
            num_new_tokens: tokens to be computed this step (draft tokens included).
            new_computed_blocks: prefix-cache hits from `get_computed_blocks` (new requests only).
            num_new_computed_tokens: tokens those hits cover.
            num_lookahead_tokens: extra slots past the new tokens (never cached).

        Returns:
            Per group, the ids of blocks newly appended to the request (hits first), or None when
            some group has not enough free blocks (then only window-freed blocks changed).
        """
        rid = request.request_id
        hits = (new_computed_blocks.blocks if new_computed_blocks is not None
                else tuple([] for _ in self.groups))
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        for group in self.groups:
            group.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_slots = total + num_lookahead_tokens
        for group, group_hits in zip(self.groups, hits):
            if (group.get_num_blocks_to_allocate(rid, num_slots, group_hits, total)
                    > group.block_pool.get_num_free_blocks()):
                return None
        new_ids = tuple([b.block_id for b in group.allocate(rid, num_slots, group_hits, total)]
                        for group, group_hits in zip(self.groups, hits))
        if self.enable_caching:
            # Only blocks whose tokens are all known (and computed by the end of this step) can be
            # cached.
            num_full = min(total, request.num_tokens) // self.block_size
            for group in self.groups:
                group.cache_blocks(rid, request.block_hashes, num_full)
        return new_ids

    def free(self, request: Request) -> None:
        """Release a request's blocks in every group; its tail blocks are evicted first."""
        hashes = request.block_hashes if self.enable_caching else None
        for group in self.groups:
            group.free(request.request_id, hashes, request.num_computed_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g.req_to_blocks.get(request_id, [])]
                     for g in self.groups)

    def num_live_blocks(self, request_id: str) -> tuple[int, ...]:
        """Blocks the request holds in each group (null entries excluded)."""
        return tuple(g.num_live_blocks(request_id) for g in self.groups)

    def reset_prefix_cache(self) -> int:
        """Drop all prefix-cache entries and the hit statistics; returns entries dropped."""
        self.prefix_cache_stats = PrefixCacheStats()
        return sum(g.block_pool.reset_prefix_cache() for g in self.groups)

    def check_invariants(self) -> None:
        """Raise AssertionError if a pool's bookkeeping is inconsistent."""
        for group in self.groups:
            group.block_pool.check_invariants()
