"""KVCacheManager: per-request block lists on top of the BlockPool, with prefix-cache lookup.

The scheduler talks to this class only: `get_computed_blocks` (prefix hits for a new request),
`allocate_slots` (blocks for the tokens scheduled this step, or None when the cache is full) and
`free`. Block ids cross to the worker as plain ints.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start or the last reset, in tokens."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Map requests to KV blocks.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of a request's leading blocks already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefixes the request's tokens.

        At most `num_tokens - 1` tokens count as hits: the last token is always recomputed so that
        its logits exist. A request that wants prompt logprobs gets no hits (the logprobs of
        cached positions were never computed), though its blocks are still cached for others.
        Returns (blocks, num_computed_tokens).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (in tokens)."""
        if self.enable_caching:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Args:
            request: the request (its `num_computed_tokens` is the tokens already in its blocks).
            num_new_tokens: tokens to be computed this step.
            new_computed_blocks: prefix-cache hits from `get_computed_blocks` (new requests only).
            num_new_computed_tokens: tokens those hits cover.
            num_lookahead_tokens: extra slots past the new tokens (never cached).

        Returns:
            The ids of blocks newly appended to the request (hits first), or None when there are
            not enough free blocks (nothing is changed then).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-(total + num_lookahead_tokens) // self.block_size)
        num_new = num_required - len(blocks) - len(new_computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Only blocks whose tokens are all known (and computed by the end of this step) can be
            # cached.
            num_full = min(total, request.num_tokens) // self.block_size
            num_cached = self.num_cached_block.get(request.request_id,
                                                   len(new_computed_blocks))
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached,
                                                  num_full)
                num_cached = num_full
            self.num_cached_block[request.request_id] = num_cached
        return [b.block_id for b in new_computed_blocks + new_blocks]

    def free(self, request: Request) -> None:
        """Release a request's blocks; its tail blocks become the first eviction candidates."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> int:
        """Drop all prefix-cache entries and the hit statistics; returns entries dropped."""
        self.prefix_cache_stats = PrefixCacheStats()
        return self.block_pool.reset_prefix_cache()
