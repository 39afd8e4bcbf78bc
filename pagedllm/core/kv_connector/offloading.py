"""The OffloadingConnector's scheduler side: a tier of KV blocks beyond the device cache (host
memory; `--kv-offloading-size` GiB), keyed by the blocks' prefix hashes, with LRU eviction.

Every full block a step computes (prompt or output) is stored to the tier after that step's
forward unless its hash is there already, so the blocks of finished requests and the blocks the
device cache later evicts stay available. A new request whose device prefix hit ends where the
tier still holds the following blocks (by hash, consecutively) gets them loaded back into fresh
device blocks before its first forward instead of recomputing them.

The tier's index (hash -> slot, LRU order) lives here; the bytes live in the workers, which only
see slot numbers (`OffloadingMetadata`). The workers' transfers run beside the forward
(worker/kv_connector/offloading.py), but a step's loads land before the layers that read them
and its stores are done when the step ends, so no block is freed or reused while a transfer
still reads it (`request_finished` never delays a free). Slots loaded or stored in a step are
pinned for that step (never evicted for another store of the same step).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedllm.core.kv_connector.base import KVConnectorStats
from pagedllm.core.kv_connector.disk_tier import DiskTierIndex
from pagedllm.core.request import Request
from pagedllm.core.sched_output import SchedulerOutput


@dataclass
class OffloadingMetadata:
    """One step's transfers: device block `load_block_ids[i]` <- host slot `load_slots[i]`
    before the forward; host slot `store_slots[i]` <- device block `store_block_ids[i]` after;
    the same with the disk tier's files, named by hash."""

    load_block_ids: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    store_block_ids: list[int] = field(default_factory=list)
    store_slots: list[int] = field(default_factory=list)
    # The disk tier (disk_tier.py): device block <- the block file of a hash before the
    # forward; the block file of a hash <- device block after it.
    disk_load_block_ids: list[int] = field(default_factory=list)
    disk_load_hashes: list[bytes] = field(default_factory=list)
    disk_store_block_ids: list[int] = field(default_factory=list)
    disk_store_hashes: list[bytes] = field(default_factory=list)


@dataclass
class _RequestState:
    request: Request
    block_ids: list[int]    # its device blocks (KV cache group 0), in order
    num_stored: int = 0     # its first blocks already stored or found in the tier


class OffloadingConnectorScheduler:
    """See the module docstring.

    Args:
        block_size: tokens per block.
        num_slots: blocks the tier holds (the workers size it from the GiB budget).
        kv_role: "kv_both" (store and load), "kv_producer" (store only) or "kv_consumer"
            (load only).
        disk: the disk tier's index (None: no disk tier); every stored block is also written
            there (write-through), and a block missing from host memory is looked up there.
        disk_block_bytes: one block's files over all ranks.
    """

    def __init__(self, block_size: int, num_slots: int, kv_role: str = "kv_both",
                 disk: DiskTierIndex | None = None, disk_block_bytes: int = 0) -> None:
        self.block_size = block_size
        self.disk = disk
        self.disk_block_bytes = disk_block_bytes
        self._disk_pinned: set[bytes] = set()
        self.num_slots = num_slots
        self.loads_enabled = kv_role in ("kv_both", "kv_consumer")
        self.stores_enabled = kv_role in ("kv_both", "kv_producer")
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()   # LRU order, oldest first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._requests: dict[str, _RequestState] = {}
        # Per request matched in get_num_new_matched_tokens: (first block, blocks queried).
        self._matched: dict[str, tuple[int, int]] = {}
        self._loads = OffloadingMetadata()
        self._pinned: set[int] = set()
        self._stats = KVConnectorStats()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if (not self.loads_enabled or num_computed_tokens % self.block_size
                or request.sampling_params.prompt_logprobs is not None):
            return 0   # (prompt logprobs: every position must be computed, as for device hits)
        start = num_computed_tokens // self.block_size
        end = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        n = 0
        while start + n < end and self._in_a_tier(request.block_hashes[start + n]):
            n += 1
        self._matched[request.request_id] = (start, max(end - start, 0))
        return n * self.block_size

    def _in_a_tier(self, block_hash: bytes) -> bool:
        """In host memory, or on disk with every rank's file intact (checked now)."""
        return block_hash in self._slot_of or (
            self.disk is not None and block_hash in self.disk and self.disk.check(block_hash))

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self._requests[request.request_id] = _RequestState(request, list(block_ids))
        start, queried = self._matched.pop(request.request_id, (0, 0))
        n = num_external_tokens // self.block_size
        self._stats.queries += queried
        self._stats.hits += n
        for i in range(start, start + n):
            block_hash = request.block_hashes[i]
            slot = self._slot_of.get(block_hash)
            if slot is None:   # (matched on disk)
                self.disk.touch(block_hash)
                self._disk_pinned.add(block_hash)
                self._loads.disk_load_block_ids.append(block_ids[i])
                self._loads.disk_load_hashes.append(block_hash)
                continue
            self._slot_of.move_to_end(block_hash)
            self._loads.load_block_ids.append(block_ids[i])
            self._loads.load_slots.append(slot)
            self._pinned.add(slot)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata:
        meta, self._loads = self._loads, OffloadingMetadata()
        self._stats.loaded_blocks += len(meta.load_slots) + len(meta.disk_load_hashes)
        self._stats.disk_loaded_blocks += len(meta.disk_load_hashes)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids.extend(new_block_ids[0])
        if self.stores_enabled:
            for req_id in scheduler_output.num_scheduled_tokens:
                state = self._requests.get(req_id)
                if state is not None:
                    self._store_full_blocks(state, meta)
        self._pinned = set()
        self._disk_pinned = set()
        return meta

    def _store_full_blocks(self, state: _RequestState, meta: OffloadingMetadata) -> None:
        """Store the request's blocks full by the end of this step that the tier lacks."""
        request = state.request
        num_full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size,
                       len(request.block_hashes), len(state.block_ids))
        for i in range(state.num_stored, num_full):
            block_hash = request.block_hashes[i]
            if self.disk is not None:
                # (check: a file indexed at start-up but corrupt is dropped and written anew)
                if block_hash in self.disk and self.disk.check(block_hash):
                    self.disk.touch(block_hash)
                else:
                    self._disk_pinned.add(block_hash)
                    self._stats.evicted_blocks += self.disk.add(
                        block_hash, self.disk_block_bytes, self._disk_pinned)
                    meta.disk_store_block_ids.append(state.block_ids[i])
                    meta.disk_store_hashes.append(block_hash)
                    self._stats.disk_stored_blocks += 1
            if block_hash in self._slot_of:
                self._slot_of.move_to_end(block_hash)
            else:
                slot = self._allocate_slot()
                if slot is None:
                    return   # every slot is pinned this step: the rest waits for a later one
                self._slot_of[block_hash] = slot
                meta.store_block_ids.append(state.block_ids[i])
                meta.store_slots.append(slot)
                self._stats.stored_blocks += 1
            state.num_stored = i + 1

    def _allocate_slot(self) -> int | None:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            self._stats.evicted_blocks += 1
        self._pinned.add(slot)
        return slot

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict | None]:
        self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    def discard_blocks(self, block_hashes: list[bytes]) -> None:
        """Forget these blocks in both tiers (their loads failed: a host slot a step filled
        from the failed device block, and the changed files, must never be hit again)."""
        for block_hash in block_hashes:
            slot = self._slot_of.pop(block_hash, None)
            if slot is not None:
                self._free_slots.append(slot)
            if self.disk is not None:
                self.disk.remove(block_hash)

    def update_worker_infos(self, worker_infos: list[dict]) -> None:
        if self.disk is not None:
            self.disk.layouts = [info["layout"] for info in worker_infos]

    def reset_cache(self) -> None:
        self._slot_of.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        for state in self._requests.values():
            state.num_stored = 0
        self._loads = OffloadingMetadata()
        self._pinned = set()
        self._disk_pinned = set()
        if self.disk is not None:
            self.disk.clear()

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(**vars(self._stats))

    def shutdown(self) -> None:
        """Nothing to release: the tiers' bytes live in the workers."""

    @property
    def num_tier_blocks_used(self) -> int:
        return len(self._slot_of)
