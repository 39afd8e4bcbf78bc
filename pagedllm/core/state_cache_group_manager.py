"""StateCacheGroupManager: the state slots of a hybrid model's recurrent layers (one group).

A state "block" is a slot of every recurrent layer's state tensors (convolution window and SSM /
recurrent state, worker/state_cache.py): a request takes one at its first allocation and keeps
it until it finishes or is preempted; its length never matters. Preemption frees the slot, and
the request's state is recomputed from its tokens when it is scheduled again (it comes back with
`num_computed_tokens` 0, which is what tells the layers to start from a zero state).

Prefix caching mode "none" (`StateCacheGroupManager`): no hits are ever reported here, so
`KVCacheManager.get_computed_blocks` (which takes the shortest hit over all groups) gives a
hybrid model's requests none.

Mode "align" (`AlignedStateCacheGroupManager`, vLLM's mamba_cache_mode "align"): a request's
entries are position-aligned like a full-attention group's blocks; entry j stands for the state
after positions [0, (j + 1) * block_size). A step that computes positions c .. e - 1 reads the
state of entry (c - 1) // block_size and writes its final state to entry (e - 1) // block_size
(the worker copies the slot first when they differ; layers/state_cache.py), so entry j holds
the exact state at its block's end when a step ended there; the scheduler ends prefill chunks on
block boundaries so that they do (`align_prefill_tokens`):

    block_size 4, prompt of 10 tokens: steps [0, 8) then [8, 10)
    entries   | null | s(8) | s(10) ...        s(8): a checkpoint, registered under hash[1]

Such an entry is registered under the block's hash (at the request's next step or when it is
freed, so that no request admitted in the step that writes it reads it first) and stays a hit
after the request frees it, until the pool evicts it (least recently freed first, the
BlockPool's free queue). Entries before the one a step reads are freed as the request moves on,
so it holds at most 2 slots. A hit is the longest block run whose last block has a checkpoint
(`find_longest_cache_hit`); the KV cache manager shortens it until every group agrees. The same
duck-typed interface as `KVCacheGroupManager`, which the KV cache manager drives.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, cdiv


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
                                   new_computed_blocks: list[KVCacheBlock],
                                   num_computed_after_step: int | None = None) -> int:
        """1 for a request without a slot, else 0."""
        return 0 if request_id in self.req_to_blocks else 1

    def allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock],
                 num_computed_after_step: int | None = None) -> list[KVCacheBlock]:
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

    def free(self, request_id: str, block_hashes: list[bytes] | None = None) -> None:
        self.block_pool.free_blocks(self.req_to_blocks.pop(request_id, []))

    def num_live_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))


class AlignedStateCacheGroupManager:
    """State entries of each request in prefix-caching mode "align" (see the module docstring).

    Args:
        spec: the group (`spec.state` and `spec.align`; `num_blocks` slots, null slot 0
            included: `num_state_slots(max_num_seqs, True)`).
        block_size: tokens per block (the attention groups' and the block hashes').
        enable_caching: register checkpoints under block hashes (off: slots are only moved).
    """

    sliding_window = None

    def __init__(self, spec: KVCacheGroupSpec, block_size: int, enable_caching: bool) -> None:
        if not (spec.state and spec.align):
            raise ValueError("AlignedStateCacheGroupManager needs a state group spec in mode "
                             "'align'")
        self.block_size = block_size
        self.block_pool = BlockPool(spec.num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request -> entry a step being scheduled ends on exactly (a checkpoint once it ran).
        self._pending: dict[str, int] = {}
        # request -> entry of a step already scheduled earlier: registered by `cache_blocks`.
        self._ready: dict[str, int] = {}
        self.num_window_freed_blocks = 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the entries before the one the next step reads, (num_computed_tokens - 1) //
        block_size; registered checkpoints among them stay hits until evicted."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or num_computed_tokens < 1:
            return
        null = self.block_pool.null_block
        removed = []
        for j in range(min((num_computed_tokens - 1) // self.block_size, len(blocks))):
            if blocks[j] is not null:
                removed.append(blocks[j])
                blocks[j] = null
        self.block_pool.free_blocks(removed)

    def _write_entries(self, num_tokens: int, num_computed_after_step: int | None) -> range:
        """Entries a step may write: from that of its last token to that of its last slot (a
        multi-step round's decodes write one entry after the other)."""
        end = num_tokens if num_computed_after_step is None else num_computed_after_step
        return range((max(end, 1) - 1) // self.block_size, cdiv(num_tokens, self.block_size))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock],
                                   num_computed_after_step: int | None = None) -> int:
        """Free slots an allocation takes: a new slot per write entry the request lacks, and
        the hit's checkpoint when it sits in the free queue."""
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        entries = self._write_entries(num_tokens, num_computed_after_step)
        num_new = max(0, entries.stop - max(entries.start, num_held))
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock],
                 num_computed_after_step: int | None = None) -> list[KVCacheBlock]:
        """Take the hit (null entries, then the checkpoint) and a slot for each write entry,
        null entries between. Returns the entries appended (hits first).

        The entry the previous step scheduled ends on (if it ended on a block's end) becomes
        registrable now, and this step's one pending."""
        if request_id in self._pending:
            self._ready[request_id] = self._pending.pop(request_id)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        start = len(blocks)
        entries = self._write_entries(num_tokens, num_computed_after_step)
        null = self.block_pool.null_block
        blocks.extend([null] * max(0, entries.start - len(blocks)))
        blocks.extend(self.block_pool.get_new_blocks(max(0, entries.stop - len(blocks))))
        end = num_tokens if num_computed_after_step is None else num_computed_after_step
        if end > 0 and end % self.block_size == 0:
            self._pending[request_id] = end // self.block_size - 1
        return new_computed_blocks + blocks[start:]

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_full: int) -> None:
        """Register the checkpoint of the request's previous step (if it ended on a block's
        end, its block is full and the request still holds the entry)."""
        j = self._ready.pop(request_id, None)
        blocks = self.req_to_blocks.get(request_id, [])
        if j is not None and j < min(num_full, len(block_hashes), len(blocks)):
            self.block_pool.cache_full_blocks(blocks, block_hashes, j, j + 1)

    def find_longest_cache_hit(self, block_hashes: list[bytes],
                               max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest e <= `max_num_blocks` whose block e - 1 has a checkpoint: e - 1 null
        entries and the checkpoint ([] when none)."""
        pool = self.block_pool
        for e in range(min(max_num_blocks, len(block_hashes)), 0, -1):
            block = pool.get_cached_block(block_hashes[e - 1])
            if block is not None:
                return [pool.null_block] * (e - 1) + [block]
        return []

    def free(self, request_id: str, block_hashes: list[bytes] | None = None) -> None:
        """Release the request's slots; its checkpoints stay hits until evicted. With
        `block_hashes`, its last steps' checkpoints are registered first: a request is freed
        (finished, or preempted) in a later scheduler call than the one that scheduled its last
        step, which has run, or runs before any step scheduled from now on."""
        for entries in (self._ready, self._pending):
            j = entries.pop(request_id, None)
            blocks = self.req_to_blocks.get(request_id, [])
            if j is not None and block_hashes is not None and j < min(len(block_hashes),
                                                                      len(blocks)):
                self.block_pool.cache_full_blocks(blocks, block_hashes, j, j + 1)
        self.block_pool.free_blocks(self.req_to_blocks.pop(request_id, []))

    def num_live_blocks(self, request_id: str) -> int:
        null = self.block_pool.null_block
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not null)


def align_prefill_tokens(num_prompt_tokens: int, num_tokens: int, num_computed: int,
                         num_new_tokens: int, block_size: int) -> int:
    """Mode "align": `num_new_tokens` cut so that a prefill step ends on a block boundary, where
    its final state becomes a checkpoint (vLLM's `Scheduler._mamba_block_aligned_split`).

    A step that would end before the last block boundary a prefix hit of the request's tokens
    can reach, `last = (num_tokens - 1) // block_size * block_size` (a hit leaves at least one
    token to compute), ends at the last boundary it reaches (unless it reaches none: a chunk
    budget under a block); a step that would pass `last` ends there, and the tokens after it
    follow in the next step. Decodes (and the tail after `last`) are left alone:

        block_size 16, 70 prompt tokens, budget 40:  [0, 32) [32, 64) [64, 70)
        the same unchunked:                          [0, 64) [64, 70)
        64 prompt tokens:                            [0, 48) [48, 64)

    (vLLM's last position is num_tokens rounded down, so an identical prompt of a multiple of
    block_size tokens gets no hit there.)

    Args:
        num_prompt_tokens, num_tokens: the request's prompt and all tokens (outputs included).
        num_computed: its computed tokens (prefix hits included).
        num_new_tokens: what the scheduler would compute this step.
        block_size: tokens per block.
    """
    if num_new_tokens <= 0 or num_computed >= max(num_prompt_tokens, num_tokens - 1):
        return num_new_tokens
    last = (num_tokens - 1) // block_size * block_size
    end = num_computed + num_new_tokens
    if end < last:
        aligned = end // block_size * block_size
        return aligned - num_computed if aligned > num_computed else num_new_tokens
    if num_computed < last < end:
        return last - num_computed
    return num_new_tokens
