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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group.

    Attributes:
        sliding_window: the layers' window in tokens (a query at position p reads keys > p - W);
            None = full attention.
        num_blocks: blocks of the group's pool, the null block included.
    """

    sliding_window: int | None
    num_blocks: int


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


def max_blocks_per_request(sliding_window: int | None, num_tokens: int, block_size: int,
                           max_num_scheduled_tokens: int, num_lookahead_tokens: int = 0) -> int:
    """Most blocks one request of `num_tokens` tokens holds at once in a group, when each step
    schedules at most `max_num_scheduled_tokens` of its tokens (plus lookahead slots).

    Held after an allocation: blocks [num_skipped(c), cdiv(c + s + la, bs)), fewer than
    (W - 1 + s + la) / bs + 2 of them.
    """
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    return min(full, cdiv(sliding_window - 1 + max_num_scheduled_tokens + num_lookahead_tokens,
                          block_size) + 1)


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
        windows: the groups' windows, from `kv_cache_group_windows`.
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
        cap = sliding_window_block_cap(window, block_size, max_num_seqs, max_num_batched_tokens,
                                       num_lookahead_tokens)
        specs.append(KVCacheGroupSpec(window, min(num_blocks, cap)))
    return tuple(specs)


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
    if len(group_bytes_per_block) != len(windows):
        raise ValueError(f"{len(group_bytes_per_block)} group sizes for {len(windows)} groups")

    def cost(n: int) -> int:
        specs = make_kv_cache_groups(n, windows, block_size, max_num_seqs,
                                     max_num_batched_tokens, num_lookahead_tokens)
        return sum(s.num_blocks * b for s, b in zip(specs, group_bytes_per_block))

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
