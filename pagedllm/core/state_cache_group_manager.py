"""StateCacheGroupManager: the state slots of a hybrid model's recurrent layers (one group).

A state "block" is a slot of every recurrent layer's state tensors (convolution window and SSM /
recurrent state, worker/state_cache.py): a request takes one at its first allocation and keeps
it until it finishes or is preempted; its length never matters. Preemption frees the slot, and
the request's state is recomputed from its tokens when it is scheduled again (it comes back with
`num_computed_tokens` 0, which is what tells the layers to start from a zero state).

Prefix caching mode "none": no hits are ever reported here, so `KVCacheManager.get_computed_blocks`
(which takes the shortest hit over all groups) gives a hybrid model's requests none. The same
duck-typed interface as `KVCacheGroupManager`, which the KV cache manager drives.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec


class StateCacheGroupManager:
    """Allocate and free the state slot of each request.

    Args:
        spec: the group (`spec.state`; `num_blocks` slots, the null slot 0 included).
        block_size: tokens per block of the other groups (unused: a slot holds any length).
        enable_caching: ignored; a state slot is never a prefix-cache entry (mode "none").
    """

    sliding_window = None

    def __init__(self, spec: KVCacheGroupSpec, block_size: int, enable_caching: bool) -> None:
        if not spec.state:
            raise ValueError("StateCacheGroupManager needs a state group spec")
        self.block_size = block_size
        self.block_pool = BlockPool(spec.num_blocks, False)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_window_freed_blocks = 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing leaves a state slot while its request runs."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock]) -> int:
        """1 for a request without a slot, else 0."""
        return 0 if request_id in self.req_to_blocks else 1

    def allocate(self, request_id: str, num_tokens: int,
                 new_computed_blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The request's slot, taken now if it has none (returned then; else [])."""
        if request_id in self.req_to_blocks:
            return []
        blocks = self.block_pool.get_new_blocks(1)
        self.req_to_blocks[request_id] = blocks
        return list(blocks)

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_full: int) -> None:
        """States are not prefix-cached (mode "none")."""

    def find_longest_cache_hit(self, block_hashes: list[bytes],
                               max_num_blocks: int) -> list[KVCacheBlock]:
        """No hit (mode "none"): a state exists only at the end of its own request's tokens."""
        return []

    def free(self, request_id: str) -> None:
        self.block_pool.free_blocks(self.req_to_blocks.pop(request_id, []))

    def num_live_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))
