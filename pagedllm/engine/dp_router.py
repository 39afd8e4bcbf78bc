"""Which data-parallel replica serves a new request (`--data-parallel-routing-policy`).

- `least_loaded`: the live replica with the fewest requests in flight (ties: the lowest index).
- `round_robin`: the live replicas in turn.
- `prefix_aware` (the default): the replica most likely to hold the prompt's prefix in its KV
  cache, unless it is overloaded, else the least loaded one. The router remembers, for the
  block hashes of the prompts it routed (the KV cache's own chained hashes,
  `core/kv_cache_utils.hash_block_tokens`, over the first `max_prefix_blocks` full blocks),
  which replica it sent them to; a new prompt goes where its longest remembered prefix went. The
  memory is approximate, as in SGLang's cache-aware router and Ray Serve's prefix-aware router:
  an entry expires after `ttl_s` (the replica may have evicted the blocks since) and the table
  holds at most `capacity` hashes (least recently used dropped first). Overloaded: the chosen
  replica has more than `imbalance` requests in flight above the least loaded one, so a hot
  prefix cannot pile every request on one replica.

The routers are plain Python over token ids and load counts: no engine, no torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from pagedllm.config import ROUTING_POLICIES
from pagedllm.core.kv_cache_utils import NONE_HASH, hash_block_tokens


class Router(Protocol):
    """Picks a replica for each new request."""

    def route(self, token_ids: Sequence[int] | None, in_flight: Sequence[int],
              live: Sequence[int]) -> int:
        """The index of the replica for a request whose prompt is `token_ids` (None: not known
        as ids), given each replica's requests in flight and the live replicas' indices (never
        empty)."""
        ...


def least_loaded(in_flight: Sequence[int], live: Sequence[int]) -> int:
    """The live replica with the fewest requests in flight (ties: the lowest index)."""
    return min(live, key=lambda i: (in_flight[i], i))


class LeastLoadedRouter:
    """Fewest requests in flight."""

    def route(self, token_ids: Sequence[int] | None, in_flight: Sequence[int],
              live: Sequence[int]) -> int:
        return least_loaded(in_flight, live)


class RoundRobinRouter:
    """The live replicas in turn."""

    def __init__(self) -> None:
        self._next = 0

    def route(self, token_ids: Sequence[int] | None, in_flight: Sequence[int],
              live: Sequence[int]) -> int:
        choice = next((i for i in sorted(live) if i >= self._next), min(live))
        self._next = choice + 1
        return choice


class PrefixAwareRouter:
    """Route by the longest remembered prompt prefix (see the module docstring).

    Args:
        block_size: the KV cache's tokens per block (hashes cover full blocks).
        max_prefix_blocks: most leading blocks hashed per prompt.
        capacity: most block hashes remembered.
        ttl_s: seconds after which a remembered hash no longer counts.
        imbalance: requests in flight above the least loaded replica's past which the prefix's
            replica is passed over.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, block_size: int, max_prefix_blocks: int = 256, capacity: int = 1 << 16,
                 ttl_s: float = 600.0, imbalance: int = 8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_size < 1 or max_prefix_blocks < 1 or capacity < 1 or imbalance < 0:
            raise ValueError("block_size, max_prefix_blocks and capacity must be >= 1, "
                             "imbalance >= 0")
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.imbalance = imbalance
        self._clock = clock
        # block hash -> (replica, time last routed); oldest first.
        self._table: OrderedDict[bytes, tuple[int, float]] = OrderedDict()

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained hashes of the prompt's leading full blocks."""
        hashes, parent = [], NONE_HASH
        num_blocks = min(len(token_ids) // self.block_size, self.max_prefix_blocks)
        for b in range(num_blocks):
            parent = hash_block_tokens(parent, token_ids[b * self.block_size:
                                                         (b + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def cached_replica(self, hashes: Sequence[bytes], live: Sequence[int]) -> int | None:
        """The live replica the longest remembered, unexpired prefix of `hashes` went to."""
        now, best = self._clock(), None
        for block_hash in hashes:
            entry = self._table.get(block_hash)
            if entry is None or now - entry[1] > self.ttl_s:
                break
            if entry[0] in live:
                best = entry[0]
        return best

    def route(self, token_ids: Sequence[int] | None, in_flight: Sequence[int],
              live: Sequence[int]) -> int:
        least = least_loaded(in_flight, live)
        if token_ids is None:
            return least
        hashes = self.prefix_hashes(token_ids)
        cached = self.cached_replica(hashes, live)
        choice = least if cached is None or in_flight[cached] - in_flight[least] > \
            self.imbalance else cached
        now = self._clock()
        for block_hash in hashes:
            self._table[block_hash] = (choice, now)
            self._table.move_to_end(block_hash)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)
        return choice


def make_router(policy: str, block_size: int) -> Router:
    """The router of `policy` (one of ROUTING_POLICIES).

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "prefix_aware":
        return PrefixAwareRouter(block_size)
    if policy == "least_loaded":
        return LeastLoadedRouter()
    if policy == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"data_parallel_routing_policy must be one of {list(ROUTING_POLICIES)}, "
                     f"got {policy!r}")
