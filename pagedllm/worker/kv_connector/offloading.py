"""The OffloadingConnector's worker side: the host-memory tier's bytes (one tensor per layer,
[2, num_slots, block_size, num_kv_heads, head_size], the layout of a device block), and the
copies between it and the device cache that the scheduler side orders by slot number
(core/kv_connector/offloading.py). On CUDA the tier is pinned host memory; on the CPU it is
ordinary memory too (a separate, larger budget than the device cache's, on the same code path).

Transfers are asynchronous (async_copy.py; `async_transfers: false` makes them synchronous):
`start_load_kv` queues the step's disk reads, then one load per layer in layer order, and
layer i's attention waits only for its own (`wait_for_layer_load`); `save_kv_layer` queues
layer i's device-to-host copies right after layer i wrote its K/V, and `wait_for_save` waits
for them (they read device blocks the next step may reuse) and then writes the step's disk
files (synchronously).
"""

from __future__ import annotations

import math

import torch

from pagedllm.config import check_offloading_size
from pagedllm.core.kv_connector.disk_tier import (block_file, decode_block_file,
                                                  encode_block_file, make_tier_folder,
                                                  write_block_file)
from pagedllm.core.kv_connector.offloading import OffloadingMetadata
from pagedllm.worker.kv_connector.async_copy import CopyQueue, wait_all
from pagedllm.worker.kv_connector.base import (block_row_columns, check_unquantized,
                                               copy_rows_to_layer, kv_layout)

GiB = 1 << 30


class OffloadingConnectorWorker:
    """See the module docstring.

    Args:
        extra_config: `kv_offloading_size` (GiB, > 0): the host tier's budget on this rank;
            `kv_offloading_dir`: the disk tier's folder (core/kv_connector/disk_tier.py);
            `async_transfers` (default True): transfers on a background copy thread.
        kv_caches: this rank's KV tensors by layer name.
        bytes_per_block: one block over all of them.
        device: the KV cache's device.

    Raises:
        ValueError: a missing or bad size, a quantized KV cache (its scales share the
            allocation), or a budget under one block.
    """

    def __init__(self, extra_config: dict, kv_caches: dict[str, torch.Tensor],
                 bytes_per_block: int, device: torch.device, rank: int = 0,
                 fingerprint: str = "") -> None:
        size = extra_config.get("kv_offloading_size")
        check_offloading_size(size, "OffloadingConnector: kv_offloading_size")
        self.num_slots = int(size * GiB) // bytes_per_block
        if self.num_slots < 1:
            raise ValueError(f"OffloadingConnector: {size} GiB holds no block of "
                             f"{bytes_per_block} bytes")
        self.device = device
        self.bytes_per_block = bytes_per_block
        self.rank = rank
        self.fingerprint = fingerprint
        directory = extra_config.get("kv_offloading_dir")
        self.disk_dir = make_tier_folder(directory) if directory else None
        # Disk stores of the step: layer name -> [n, 2, block_size, heads, head_size] on host.
        self._disk_rows: dict[str, torch.Tensor] = {}
        self._pin = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self.register_kv_caches(kv_caches)
        self._meta: OffloadingMetadata | None = None
        self._queue = CopyQueue(device, extra_config.get("async_transfers", True))
        self._loads: dict = {}   # layer name -> the tickets of its loads this step
        self._saves: list = []   # the step's save tickets
        self._failed_block_ids: set[int] = set()   # (get_block_ids_with_load_errors)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        check_unquantized("OffloadingConnector", kv_caches)
        for name, cache in kv_caches.items():
            shape = (2, self.num_slots) + tuple(cache.shape[2:])
            host = self._host.get(name)
            if host is None or host.shape != shape or host.dtype != cache.dtype:
                self._host[name] = self._allocate(shape, cache.dtype)
        self._kv_caches = dict(kv_caches)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor of one layer's tier; ValueError naming kv_offloading_size and
        the bytes asked (the whole tier's and this layer's) where the host cannot give it."""
        try:
            return torch.zeros(shape, dtype=dtype, pin_memory=self._pin)
        except RuntimeError as e:     # (torch.OutOfMemoryError is one; so is the CPU allocator's)
            layer_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            raise ValueError(
                f"OffloadingConnector: kv_offloading_size asks for {self.num_slots} blocks = "
                f"{self.num_slots * self.bytes_per_block} bytes of host memory, which could "
                f"not be allocated ({layer_bytes} bytes for one layer failed: "
                f"{str(e).splitlines()[0][:200]}); give a smaller kv_offloading_size") from e

    def set_model_fingerprint(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint

    def info(self) -> dict:
        return {"num_tier_blocks": self.num_slots, "layout": self.layout(),
                "block_bytes": self.bytes_per_block}

    def layout(self) -> str:
        """What a block file of this rank must say to be loaded here: the model's
        fingerprint, the rank, and each layer's name, dtype and block shape."""
        return kv_layout(self._kv_caches, self.fingerprint, self.rank)

    def bind_connector_metadata(self, metadata: object) -> None:
        self._meta = metadata if isinstance(metadata, OffloadingMetadata) else None

    def clear_connector_metadata(self) -> None:
        self._meta = None
        self._loads, self._saves, self._disk_rows = {}, [], {}

    def start_load_kv(self) -> None:
        """Queue the step's loads: the disk files' reads, then per layer (in order) its host
        slots' and files' blocks into their device blocks."""
        meta = self._meta
        if meta is None or not (meta.load_slots or meta.disk_load_hashes):
            return
        disk_rows: list[torch.Tensor] = []   # (filled by the read, before the layers' copies)
        read = None
        if meta.disk_load_hashes:
            read = self._queue.submit(lambda: disk_rows.append(self._read_block_files(meta)))
        columns = block_row_columns(self._kv_caches)
        slots = torch.tensor(meta.load_slots, dtype=torch.int64)
        blocks = torch.tensor(meta.load_block_ids, dtype=torch.int64)
        for name, cache in self._kv_caches.items():
            layer = self._queue.submit(
                lambda name=name, cache=cache: self._load_layer(
                    cache, self._host[name], slots, blocks, meta, disk_rows, columns[name]))
            self._loads[name] = [t for t in (read, layer) if t is not None]

    def _load_layer(self, cache: torch.Tensor, host: torch.Tensor, slots: torch.Tensor,
                    blocks: torch.Tensor, meta: OffloadingMetadata,
                    disk_rows: list[torch.Tensor], column: tuple[int, int]) -> None:
        """One layer's loads (on the copy queue): device blocks `blocks` <- host slots
        `slots` (int64 host tensors), then the disk blocks."""
        if len(slots):
            cache.index_copy_(1, blocks.to(self.device), host.index_select(1, slots).to(
                self.device, non_blocking=True))
        if disk_rows:   # (else the read raised, and raises in whoever waits for it)
            copy_rows_to_layer(cache, meta.disk_load_block_ids, disk_rows[0], column)

    def _read_block_files(self, meta: OffloadingMetadata) -> torch.Tensor:
        """The step's disk loads' payloads, [n, bytes_per_block] uint8 (the files were checked
        by the scheduler side when it matched them; everything is checked again, the payload's
        CRC32 included, on the copy thread: a block never loads wrong bytes).

        A file that changed since it was matched (deleted or rewritten by something else) is a
        load error: its row stays zeros and its device block id is reported by
        `get_block_ids_with_load_errors`, so the scheduler recomputes it (vLLM's
        `kv_load_failure_policy="recompute"`).
        """
        rows = torch.zeros(len(meta.disk_load_hashes), self.bytes_per_block, dtype=torch.uint8)
        layout = self.layout()
        for i, block_hash in enumerate(meta.disk_load_hashes):
            path = block_file(self.disk_dir, block_hash, self.rank)
            try:
                payload = decode_block_file(path.read_bytes(), block_hash, layout)
            except OSError:
                payload = None   # (vanished after it was matched)
            if payload is None or len(payload) != self.bytes_per_block:
                self._failed_block_ids.add(meta.disk_load_block_ids[i])
                continue
            rows[i] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return rows

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids whose loads failed since the last call (vLLM's name): their
        contents are zeros, not the stored KV. Call after `wait_for_save`."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer `layer_name`'s loads of this step are in its device blocks (the other
        layers' may still be copying). A block whose file failed to load holds zeros
        (`get_block_ids_with_load_errors`)."""
        for ticket in self._loads.pop(layer_name, ()):
            self._queue.wait(ticket)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Queue the copies of this layer's stored blocks into their tier slots (and, for
        the disk tier, to host rows that `wait_for_save` writes)."""
        meta = self._meta
        if meta is None or not (meta.store_slots or meta.disk_store_hashes):
            return
        self._saves.append(self._queue.submit(
            lambda: self._save_layer(layer_name, kv_layer, meta)))

    def _save_layer(self, name: str, kv_layer: torch.Tensor, meta: OffloadingMetadata) -> None:
        """One layer's saves (on the copy queue)."""
        if meta.store_slots:
            blocks = torch.tensor(meta.store_block_ids, dtype=torch.int64, device=self.device)
            slots = torch.tensor(meta.store_slots, dtype=torch.int64)
            self._host[name].index_copy_(1, slots, kv_layer.index_select(1, blocks).to("cpu"))
        if meta.disk_store_hashes:
            blocks = torch.tensor(meta.disk_store_block_ids, dtype=torch.int64,
                                  device=self.device)
            # [n, 2, block_size, heads, head_size]: each block's K and V together
            self._disk_rows[name] = kv_layer.index_select(1, blocks).transpose(0, 1).to("cpu")

    def wait_for_save(self) -> None:
        """Wait for the step's device-to-host copies (and any load no layer waited for),
        then write the step's disk files (each block's file holds every layer).

        Raises:
            RuntimeError: a load of this step failed and no layer waited for it.
        """
        tickets = [t for ts in self._loads.values() for t in ts] + self._saves
        self._loads, self._saves = {}, []
        wait_all(self._queue, tickets)
        meta = self._meta
        if meta is None or not meta.disk_store_hashes:
            return
        layout = self.layout()
        rows = [self._disk_rows[name].contiguous() for name in self._kv_caches]
        self._disk_rows = {}
        for i, block_hash in enumerate(meta.disk_store_hashes):
            payload = b"".join(r[i].view(torch.uint8).numpy().tobytes() for r in rows)
            write_block_file(block_file(self.disk_dir, block_hash, self.rank),
                             encode_block_file(block_hash, layout, payload))

    def shutdown(self) -> None:
        self._queue.shutdown()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()
