"""KV cache groups: the attention layers of one type share a block table and a BlockPool.

    group 0   primary: full attention, or (no full layer) the widest window  -> a block for every
              position of a request
    group k   sliding window W_k: the layers with that window                -> blocks for the last
              W_k positions only; older blocks go back to the pool and the request's block table
              entry becomes the null block 0 (never read: those layers attend inside the window)

Memory layout (documented in docs/architecture.md, "KV cache"): every group has its own BlockPool
and its layers own KV tensors of that group's `num_blocks`. One number crosses the engine,
`num_blocks` of group 0; a sliding group gets `min(num_blocks, sliding_window_block_cap(...))`:
as many blocks as `max_num_seqs` requests can hold at once inside their windows plus one step's
tokens, never more than the primary group. So a sliding group never holds memory it cannot use,
and (with the cap above what the scheduler can fill) rarely refuses what group 0 admits; the
scheduler still checks every group (`KVCacheManager.allocate_slots`). A model with one attention
type has one group and the whole budget.

Admission: each group's spec answers how many blocks one request can hold at once
(`KVCacheGroupSpec.max_num_blocks_per_request`); `KVCacheCapacity` asks every group, and both the
front end's gate (engine/input_processor.py) and `Scheduler.add_request` refuse with its answer. A
new group type brings its own rule there, nothing else.

MLA latent caches (DeepSeek-V2/V3, docs/mla.md) are full-attention groups here: one latent
vector per position, so the same blocks per request, prefix hits and preemption; what differs is
only the bytes per block (one [kv_lora_rank + qk_rope_head_dim] vector per token and layer
instead of per-head K and V), a worker-side fact (`worker/kv_cache.py`) that sets num_blocks.

State group (`STATE_GROUP` in the group list, last): the recurrent layers of a hybrid model
(Mamba-2, short convolutions) keep a fixed-size state per request instead of a KV entry per
token (vLLM's MambaSpec). A "block" of that group is one state slot: a request holds exactly one
from its first allocation until it finishes or is preempted, whatever its length, and the pool
has one per running request (`1 + max_num_seqs`, the null block included). Its memory is the
slots' bytes (`num_blocks_for_budget` counts it like any group's). Prefix caching mode "none"
(`STATE_GROUP`): the group never reports a hit, so a hybrid model's requests get no prefix hits.
Mode "align" (`STATE_ALIGN_GROUP`, vLLM's mamba_cache_mode "align"): a request's state entries
are position-aligned like a full-attention group's blocks, a step's final state is written to the
entry of its last token, and an entry written by a step that ended on its block's end is a
checkpoint registered under that block's hash; a request holds at most 2 slots at once (the
entry it reads and the one it writes), and the pool has `max_num_seqs` more slots than in mode
"none" for those and for checkpoints (LRU; `num_state_slots`). See
core/state_cache_group_manager.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


# The group-list entry of a state cache group (beside attention groups' sliding windows).
STATE_GROUP = "state"
# The same, with prefix caching mode "align" (states checkpointed at block boundaries).
STATE_ALIGN_GROUP = "state_align"


def is_state_group(window: int | str | None) -> bool:
    """Whether a group-list entry is a state group (either prefix-caching mode)."""
    return window in (STATE_GROUP, STATE_ALIGN_GROUP)


def num_state_slots(max_num_seqs: int, align: bool) -> int:
    """Slots of a state group's pool, the null slot included: one per running request (mode
    "none"); mode "align": `max_num_seqs` more, taken by the steps that cross a block boundary
    (they read one entry and write the next) and, while free, keeping checkpoints (LRU). Where
    every running request crosses a boundary at once they are all in use, and what does not
    fit is preempted as for KV blocks."""
    return 1 + (2 * max_num_seqs if align else max_num_seqs)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group.

    Attributes:
        sliding_window: the layers' window in tokens (a query at position p reads keys > p - W);
            None = full attention.
        num_blocks: blocks of the group's pool, the null block included.
        state: a state cache group (one slot per request; `sliding_window` is None).
        align: a state group in prefix-caching mode "align" (at most 2 slots per request).
    """

    sliding_window: int | None
    num_blocks: int
    state: bool = False
    align: bool = False

    def max_num_blocks_per_request(self, num_slots: int, block_size: int,
                                   max_num_scheduled_tokens: int,
                                   num_lookahead_tokens: int = 0) -> int:
        """Most blocks of this group one request holds at once, over every state the scheduler
        can reach (any chunking under any token budget, prefix hits, recompute after preemption).

        Args:
            num_slots: most token slots the request ever has (`KVCacheCapacity.max_num_slots`).
            block_size: tokens per block.
            max_num_scheduled_tokens: most of its tokens one step computes (drafts included).
            num_lookahead_tokens: slots reserved past a step's tokens.

        Full attention: a block per position, cdiv(num_slots, block_size). Sliding window W: a
        step that computes n tokens (and reserves la slots) from c = num_computed_tokens first
        frees the blocks before position c - W + 1 (`num_skipped_blocks`), so it holds positions
        c - W + 1 .. c + n + la - 1 plus up to block_size - 1 before them in the first block:

            W = 8, block_size = 4, c = 10, n + la = 4: queries 10..13 read keys from 3 on
            positions | 0  1  2  3 | 4 .. 7 | 8 .. 11 | 12 13 .. |
            held      |        [3] |  all   |   all   |  12 13   |   4 blocks = cdiv(3 + 7 + 4, 4)

        at most cdiv(min(W + block_size - 2 + n + la, num_slots), block_size) blocks, reached
        when (c - W + 1) % block_size == block_size - 1. (vLLM's SlidingWindowSpec prices
        cdiv(min(W - 1 + max_num_batched_tokens, max_model_len), block_size) + 1, one block more
        when W - 1 + n is 1 past a multiple of block_size or all slots fit.) A state group: one
        slot, whatever the length (mode "align": 2, the entry a step reads and the one it
        writes).
        """
        if self.state:
            return 2 if self.align else 1
        if self.sliding_window is None:
            return cdiv(num_slots, block_size)
        return cdiv(min(self.sliding_window + block_size - 2 + max_num_scheduled_tokens
                        + num_lookahead_tokens, num_slots), block_size)

    def describe(self) -> str:
        if self.state:
            return "state (align)" if self.align else "state"
        return ("full attention" if self.sliding_window is None
                else f"sliding window {self.sliding_window}")


@dataclass(frozen=True)
class KVCacheCapacity:
    """What one request can hold in a KV cache at most, and whether that ever fits: the one answer
    the front end's gate and the scheduler's `add_request` both use (plain data, no torch).

    A request admitted here, alone on an empty cache, always finds its blocks: no step of it can
    need more than `max_num_blocks` in any group (the scheduler caps its tokens, drafts and
    lookahead slots at `max_num_slots`; a multi-step round's extra slots are taken only when they
    are free), so it is never preempted by its own growth. Without async scheduling and drafts
    the answer is exact: some reachable state holds that many (tests/core/
    test_kv_cache_admission.py); their extra positions, one per step, can make it a block high.

    Attributes:
        groups: the cache's groups (`make_kv_cache_groups`), group 0 first.
        block_size: tokens per block.
        max_model_len: context length in tokens.
        max_num_scheduled_tokens: most tokens of one request a step computes (drafts included):
            max_num_batched_tokens, or long_prefill_token_threshold when lower.
        num_lookahead_tokens: slots reserved past a step's tokens (a draft model's).
        computes_last_token: whether a step may compute the position of a request's last token
            (async scheduling's step after it, drafts, lookahead slots); otherwise that token is
            sampled and never fed back, and needs no slot.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    block_size: int
    max_model_len: int
    max_num_scheduled_tokens: int
    num_lookahead_tokens: int = 0
    computes_last_token: bool = False

    def max_num_slots(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Most token slots a request of `num_prompt_tokens` and `max_tokens` ever has: its
        prompt and outputs up to max_model_len, less the last token unless it can be computed
        (never less than the prompt, which is always computed)."""
        num_tokens = min(num_prompt_tokens + max_tokens, self.max_model_len)
        if self.computes_last_token:
            return num_tokens
        return max(num_prompt_tokens, num_tokens - 1)

    def max_num_blocks(self, num_prompt_tokens: int, max_tokens: int) -> tuple[int, ...]:
        """[num_groups] most blocks the request holds at once in each group."""
        num_slots = self.max_num_slots(num_prompt_tokens, max_tokens)
        return tuple(g.max_num_blocks_per_request(num_slots, self.block_size,
                                                  self.max_num_scheduled_tokens,
                                                  self.num_lookahead_tokens)
                     for g in self.groups)

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError (saying what it needs, what the cache has and what to lower) if the
        request can never fit the cache, even alone."""
        needed = self.max_num_blocks(num_prompt_tokens, max_tokens)
        usable = tuple(g.num_blocks - 1 for g in self.groups)
        refused = [i for i, (n, u) in enumerate(zip(needed, usable)) if n > u]
        if not refused:
            return
        if len(self.groups) == 1:
            need, have = f"{needed[0]} KV blocks", f"{usable[0]}"
        else:
            kinds = ", ".join(g.describe() for g in self.groups)
            need, have = f"{list(needed)} KV blocks (groups: {kinds})", f"{list(usable)}"
        lower = "max_tokens"
        if any(self.groups[i].sliding_window is not None for i in refused):
            lower += (", max_num_batched_tokens or long_prefill_token_threshold (a sliding-window "
                      "group holds the window plus one step's tokens)")
        raise ValueError(f"the request needs up to {need} of {self.block_size} tokens "
                         f"({num_prompt_tokens} prompt tokens + max_tokens {max_tokens}) but the "
                         f"KV cache has only {have}; lower {lower} or give the cache more memory")


def kv_cache_group_windows(layer_windows: Iterable[int | None]) -> tuple[int | None, ...]:
    """The distinct attention types of a model's layers, one per group: full attention (None)
    first, then windows from the widest down. Group 0 is the primary group.

    Raises:
        ValueError: for no layers, or a window < 1.
    """
    windows = set(layer_windows)
    if not windows:
        raise ValueError("a KV cache needs at least one attention layer")
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding windows must be >= 1, got {sorted(w for w in windows if w)}")
    return tuple(sorted(windows, key=lambda w: (0, 0) if w is None else (1, -w)))


def num_skipped_blocks(sliding_window: int | None, num_computed_tokens: int,
                       block_size: int) -> int:
    """Leading blocks of a request that no query at a position >= `num_computed_tokens` reads.

    A query at position p reads keys p - W + 1 .. p, so block j (positions j*bs .. (j+1)*bs - 1)
    is out of every such window when (j + 1) * bs <= num_computed_tokens - W + 1. Full attention
    skips nothing.
    """
    if sliding_window is None:
        return 0
    return max(0, (num_computed_tokens - sliding_window + 1) // block_size)


def sliding_window_block_cap(sliding_window: int, block_size: int, max_num_seqs: int,
                             max_num_batched_tokens: int, num_lookahead_tokens: int = 0) -> int:
    """Blocks (null block included) that `max_num_seqs` running requests of a sliding group hold
    at once when a step schedules `max_num_batched_tokens` tokens in all: each request its window
    and lookahead plus two partial blocks, and the step's tokens."""
    per_request = cdiv(sliding_window - 1 + num_lookahead_tokens, block_size) + 2
    return 1 + max_num_seqs * per_request + cdiv(max_num_batched_tokens, block_size)


def make_kv_cache_groups(num_blocks: int, windows: Sequence[int | None], block_size: int,
                         max_num_seqs: int, max_num_batched_tokens: int,
                         num_lookahead_tokens: int = 0) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a KV cache whose primary group (windows[0]) has `num_blocks` blocks.

    Args:
        num_blocks: blocks of group 0, the null block included.
        windows: the groups' windows, from `kv_cache_group_windows`, and `STATE_GROUP` or
            `STATE_ALIGN_GROUP` last for a model with recurrent layers (a pool of
            `num_state_slots` state slots).
        block_size, max_num_seqs, max_num_batched_tokens, num_lookahead_tokens: the scheduler's
            limits (they bound what a sliding group can hold; see `sliding_window_block_cap`).

    Raises:
        ValueError: for no windows or num_blocks < 2.
    """
    if not windows:
        raise ValueError("at least one KV cache group is needed")
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
    specs = [KVCacheGroupSpec(windows[0], num_blocks)]
    for window in windows[1:]:
        if is_state_group(window):
            align = window == STATE_ALIGN_GROUP
            specs.append(KVCacheGroupSpec(None, num_state_slots(max_num_seqs, align), state=True,
                                          align=align))
            continue
        cap = sliding_window_block_cap(window, block_size, max_num_seqs, max_num_batched_tokens,
                                       num_lookahead_tokens)
        specs.append(KVCacheGroupSpec(window, min(num_blocks, cap)))
    return tuple(specs)


def kv_cache_bytes(num_blocks: int, group_bytes_per_block: Sequence[int],
                   windows: Sequence[int | None], block_size: int, max_num_seqs: int,
                   max_num_batched_tokens: int, num_lookahead_tokens: int = 0) -> int:
    """Bytes of all the groups (`make_kv_cache_groups`) when group 0 has `num_blocks` blocks
    (>= 2); `kv_cache_bytes(2, ...)` is the smallest budget an engine can start with.

    Args:
        group_bytes_per_block: [num_groups] bytes one block (a state group: one slot) takes
            over a group's layers.
        windows, block_size, ...: as for `make_kv_cache_groups`.

    Raises:
        ValueError: as `make_kv_cache_groups`, or sizes and windows of different lengths.
    """
    if len(group_bytes_per_block) != len(windows):
        raise ValueError(f"{len(group_bytes_per_block)} group sizes for {len(windows)} groups")
    specs = make_kv_cache_groups(num_blocks, windows, block_size, max_num_seqs,
                                 max_num_batched_tokens, num_lookahead_tokens)
    return sum(s.num_blocks * b for s, b in zip(specs, group_bytes_per_block))


def num_blocks_for_budget(budget_bytes: int, group_bytes_per_block: Sequence[int],
                          windows: Sequence[int | None], block_size: int, max_num_seqs: int,
                          max_num_batched_tokens: int, num_lookahead_tokens: int = 0) -> int:
    """The largest `num_blocks` of group 0 whose groups (`make_kv_cache_groups`) fit the budget.

    Args:
        budget_bytes: KV cache memory for all groups.
        group_bytes_per_block: [num_groups] bytes one block takes over a group's layers (K and V).
        windows, block_size, ...: as for `make_kv_cache_groups`.

    Returns:
        The block count of group 0 (0 or 1 when not even two blocks fit; callers raise).
    """
    def cost(n: int) -> int:
        return kv_cache_bytes(n, group_bytes_per_block, windows, block_size, max_num_seqs,
                              max_num_batched_tokens, num_lookahead_tokens)

    if len(group_bytes_per_block) != len(windows):
        raise ValueError(f"{len(group_bytes_per_block)} group sizes for {len(windows)} groups")
    hi = max(1, budget_bytes // max(group_bytes_per_block[0], 1))
    if hi < 2 or cost(2) > budget_bytes:
        return min(hi, 1)
    lo = 2
    while lo < hi:  # largest n in [lo, hi] with cost(n) <= budget (cost is monotone in n)
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
