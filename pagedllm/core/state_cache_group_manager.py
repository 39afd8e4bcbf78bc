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
    entries   | s(4) | s(8) | s(10) ...   s(4), s(8): checkpoints under hash[0], hash[1]

The boundaries a step passes inside its query (4 above) get a slot too where enough are free
(more than `num_reserved`), and the scans emit the state there as they pass (layers/
state_cache.py, `emit_*`); without a slot the entry stays null. A multi-step round's later
steps end on block boundaries in its own entries. Each such entry is registered under the
block's hash (at the request's next step or when it is freed, so that no request admitted in
the step that writes it reads it first; only up to the tokens the request has computed by then)
and stays a hit after the request frees it, until the pool evicts it (least recently freed
first, the BlockPool's free queue). Entries before the one a step reads are freed as the
request moves on, so it holds 2 slots, and those of the boundaries inside its last step until
its next one. A hit is the longest block run whose last block has a checkpoint
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

    def free(self, request_id: str, block_hashes: list[bytes] | None = None,
             num_computed_tokens: int | None = None) -> None:
        self.block_pool.free_blocks(self.req_to_blocks.pop(request_id, []))

    def num_live_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))


class AlignedStateCacheGroupManager:
    """State entries of each request in prefix-caching mode "align" (see the module docstring).

    Args:
        spec: the group (`spec.state` and `spec.align`; `num_blocks` slots, null slot 0
            included: `num_state_slots(max_num_seqs, True)`).
        block_size: tokens per block (the attention groups' and the block hashes').
        enable_caching: register checkpoints under block hashes (off: slots are only moved,
            and no slot is taken for the boundaries inside a step).
    """

    sliding_window = None

    def __init__(self, spec: KVCacheGroupSpec, block_size: int, enable_caching: bool) -> None:
        if not (spec.state and spec.align):
            raise ValueError("AlignedStateCacheGroupManager needs a state group spec in mode "
                             "'align'")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(spec.num_blocks, enable_caching)
        # Slots the boundaries inside steps never take: one per request `max_num_seqs` can run
        # (spec.num_blocks = 1 + 2 * max_num_seqs), for the steps' required entries.
        self.num_reserved = (spec.num_blocks - 1) // 2
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request -> entries its scheduled steps write at a block's end (checkpoints once they
        # ran), and the tokens computed for certain once its last scheduled step ran.
        self._pending: dict[str, list[int]] = {}
        self._scheduled_end: dict[str, int] = {}
        # request -> its block hashes (the request's own list, extended as tokens come).
        self._hashes: dict[str, list[bytes]] = {}
        self.num_window_freed_blocks = 0

    def _register(self, request_id: str, num_computed: int,
                  block_hashes: list[bytes] | None) -> None:
        """Register the request's pending checkpoints whose blocks are computed
        (`num_computed` tokens) under their hashes; drop the rest (never written: a multi-step
        round that ended early)."""
        pending = self._pending.pop(request_id, [])
        blocks = self.req_to_blocks.get(request_id, [])
        if block_hashes is None:
            return
        null = self.block_pool.null_block
        for j in pending:
            if ((j + 1) * self.block_size <= num_computed and j < len(block_hashes)
                    and j < len(blocks) and blocks[j] is not null):
                self.block_pool.cache_full_blocks(blocks, block_hashes, j, j + 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """At the request's next step: register the checkpoints its earlier steps wrote (they
        have run, or run before any step scheduled from now on, so no request admitted in the
        step that wrote one read it first), then free the entries before the one the next
        step reads, (num_computed_tokens - 1) // block_size; registered checkpoints among them
        stay hits until evicted."""
        self._register(request_id, num_computed_tokens, self._hashes.get(request_id))
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
        """Free slots an allocation needs: a new slot per write entry the request lacks, and
        the hit's checkpoint when it sits in the free queue (the boundaries inside the step
        take slots only where more are free, `allocate`)."""
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        entries = self._write_entries(num_tokens, num_computed_after_step)
        num_new = max(0, entries.stop - max(entries.start, num_held))
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock],
                 num_computed_after_step: int | None = None) -> list[KVCacheBlock]:
        """Take the hit (null entries, then the checkpoint), a slot for each write entry, and
        between them (the block boundaries the step passes inside its query) a slot for each
        boundary while more than `num_reserved` slots are free (spread over them when fewer;
        null entries for the rest). Returns the entries appended (hits first).

        The step's checkpoints become pending: the boundaries inside it that got a slot, its
        end if on a block's end, and the block ends of a multi-step round's later steps."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        start = len(blocks)
        entries = self._write_entries(num_tokens, num_computed_after_step)
        null = self.block_pool.null_block
        gap = max(0, entries.start - len(blocks))
        num_free = self.block_pool.get_num_free_blocks() - max(0, entries.stop - entries.start)
        take = min(gap, max(0, num_free - self.num_reserved)) if self.enable_caching else 0
        # Evenly spread picks of `take` among the gap's entries (all of them when take == gap).
        picks = {start + (i + 1) * gap // take - 1 for i in range(take)} if take else set()
        new = iter(self.block_pool.get_new_blocks(take))
        blocks.extend(next(new) if start + i in picks else null for i in range(gap))
        blocks.extend(self.block_pool.get_new_blocks(max(0, entries.stop - len(blocks))))
        end = num_tokens if num_computed_after_step is None else num_computed_after_step
        if self.enable_caching:
            bs = self.block_size
            ends = range(max(cdiv(end, bs) - 1, 0), num_tokens // bs)
            self._pending[request_id] = sorted(picks) + list(ends)
        self._scheduled_end[request_id] = end
        return new_computed_blocks + blocks[start:]

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_full: int) -> None:
        """Keep the request's block hashes, for registering its checkpoints at its next step
        (`remove_skipped_blocks`)."""
        self._hashes[request_id] = block_hashes

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

    def free(self, request_id: str, block_hashes: list[bytes] | None = None,
             num_computed_tokens: int | None = None) -> None:
        """Release the request's slots; its checkpoints stay hits until evicted. With
        `block_hashes`, its last step's checkpoints are registered first: a request is freed
        (finished, or preempted) in a later scheduler call than the one that scheduled its last
        step, which has run, or runs before any step scheduled from now on. Those up to
        `num_computed_tokens` are (a multi-step round that ended early wrote no later ones);
        without it, those up to its last step's first token's end."""
        scheduled = self._scheduled_end.pop(request_id, 0)
        self._register(request_id, scheduled if num_computed_tokens is None
                       else num_computed_tokens, block_hashes)
        self._hashes.pop(request_id, None)
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
