"""The P2pShmConnector's worker side: a producer rank writes a prompt's blocks to a shared-memory
file after the forward that computed them; a consumer rank reads a pulled file into fresh device
blocks before its forward and deletes it (core/kv_connector/p2p_shm.py orders both).

A file is disk_tier.py's format with the request's digest as its hash and, as payload, the
blocks in order, each block every layer's K and V ([2, block_size, num_kv_heads, head_size]
raw bytes, layer order), so blocks [first, first + n) are one contiguous slice:

    payload = | block 0: layer 0 K V | layer 1 K V | ... | block 1: ... | ... |

Transfers are asynchronous (async_copy.py; `async_transfers: false` makes them synchronous):
a consumer queues the step's file reads, then one copy per layer in layer order, and layer i's
attention waits only for its own; a producer queues layer i's device-to-host copy right after
layer i wrote its K/V, and `wait_for_save` writes the files.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.kv_connector.disk_tier import encode_block_file, write_block_file
from pagedllm.core.kv_connector.p2p_shm import P2pShmMetadata, engine_id_of, shm_dir_of
from pagedllm.core.kv_connector.p2p_transport import read_transfer_header, transfer_file
from pagedllm.worker.kv_connector.async_copy import CopyQueue, wait_all
from pagedllm.worker.kv_connector.base import (block_row_columns, check_unquantized,
                                               copy_rows_to_layer, kv_layout)


class P2pShmConnectorWorker:
    """See the module docstring.

    Args:
        config: the `KVTransferConfig` (role, engine id, `shm_dir`).
        kv_caches: this rank's KV tensors by layer name.
        bytes_per_block: one block over all of them.
        device: the KV cache's device.
        rank: this rank (files are per rank; both instances need the same layout).
        fingerprint: the model's `model_fingerprint` (in the layout string).

    Raises:
        ValueError: a quantized KV cache, or a shared-memory folder that is not a folder.
    """

    def __init__(self, config, kv_caches: dict[str, torch.Tensor], bytes_per_block: int,
                 device: torch.device, rank: int = 0, fingerprint: str = "") -> None:
        self.engine_id = engine_id_of(config)
        self.shm_dir = shm_dir_of(config)
        if not self.shm_dir.is_dir():
            raise ValueError(f"P2pShmConnector: shm_dir {str(self.shm_dir)!r} is not a folder")
        self.bytes_per_block = bytes_per_block
        self.device = device
        self.rank = rank
        self.fingerprint = fingerprint
        self._kv_caches: dict[str, torch.Tensor] = {}
        self.register_kv_caches(kv_caches)
        self._meta: P2pShmMetadata | None = None
        # Exports of the step: layer name -> [n, 2, block_size, heads, head_size] per export.
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._queue = CopyQueue(device, config.kv_connector_extra_config.get(
            "async_transfers", True))
        self._loads: dict = {}   # layer name -> the tickets of its loads this step
        self._saves: list = []   # the step's save tickets

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        check_unquantized("P2pShmConnector", kv_caches)
        self._kv_caches = dict(kv_caches)

    def set_model_fingerprint(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint

    def layout(self) -> str:
        return kv_layout(self._kv_caches, self.fingerprint, self.rank)

    def info(self) -> dict:
        return {"layout": self.layout(), "block_bytes": self.bytes_per_block}

    def bind_connector_metadata(self, metadata: object) -> None:
        self._meta = metadata if isinstance(metadata, P2pShmMetadata) else None

    def clear_connector_metadata(self) -> None:
        self._meta = None
        self._loads, self._saves, self._rows = {}, [], {}

    def start_load_kv(self) -> None:
        """Queue the step's loads: the pulled files' reads, then per layer (in order) their
        blocks into its device blocks, then the files' deletion."""
        if self._meta is None or not self._meta.loads:
            return
        loads = self._meta.loads
        files: list[torch.Tensor] = []   # (filled by the read: [n, bytes_per_block] per load)
        read = self._queue.submit(lambda: files.extend(self._read_files(loads)))
        columns = block_row_columns(self._kv_caches)
        for name, cache in self._kv_caches.items():
            def copy(cache=cache, column=columns[name]) -> None:
                for load, rows in zip(loads, files):
                    copy_rows_to_layer(cache, load.block_ids, rows, column)
            self._loads[name] = [read, self._queue.submit(copy)]
        self._saves.append(self._queue.submit(lambda: self._delete_files(loads)))

    def _read_files(self, loads) -> list[torch.Tensor]:
        """Each load's blocks from its file, [n, bytes_per_block] uint8 (the module docstring's
        layout).

        Raises:
            RuntimeError: a file vanished or changed after the scheduler side checked it.
        """
        layout = self.layout()
        out = []
        for load in loads:
            path = transfer_file(self.shm_dir, load.engine_id, load.key, self.rank)
            offset, problem = read_transfer_header(path, load.key, layout)
            n = len(load.block_ids)
            start = offset + load.first_block * self.bytes_per_block
            if problem is None and path.stat().st_size < start + n * self.bytes_per_block:
                problem = f"{path} is too short"
            if problem is not None:
                raise RuntimeError(f"KV transfer: {problem} (after it was pulled)")
            out.append(torch.from_numpy(np.fromfile(
                path, dtype=np.uint8, count=n * self.bytes_per_block, offset=start)
            ).view(n, self.bytes_per_block))
        return out

    def _delete_files(self, loads) -> None:
        for load in loads:
            transfer_file(self.shm_dir, load.engine_id, load.key, self.rank).unlink(
                missing_ok=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer `layer_name`'s loads of this step are in its device blocks.

        Raises:
            RuntimeError: a file vanished or changed after the scheduler side checked it.
        """
        for ticket in self._loads.pop(layer_name, ()):
            self._queue.wait(ticket)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Queue the copy of this layer's blocks of the step's exports to the host."""
        if self._meta is None or not self._meta.exports:
            return
        exports = self._meta.exports

        def copy() -> None:
            self._rows[layer_name] = [
                kv_layer[:, torch.tensor(e.block_ids, dtype=torch.int64, device=self.device)]
                .transpose(0, 1).to("cpu").contiguous() for e in exports]
        self._saves.append(self._queue.submit(copy))

    def wait_for_save(self) -> None:
        """Wait for the step's copies, then write each export's file (atomically: a
        temporary name, then a rename)."""
        tickets = [t for ts in self._loads.values() for t in ts] + self._saves
        self._loads, self._saves = {}, []
        wait_all(self._queue, tickets)
        if self._meta is None or not self._meta.exports:
            return
        layout = self.layout()
        rows = [self._rows[name] for name in self._kv_caches]
        self._rows = {}
        for i, export in enumerate(self._meta.exports):
            n = len(export.block_ids)
            # [n, bytes_per_block]: each block's layers in order (the module docstring).
            payload = torch.cat([layer[i].view(torch.uint8).view(n, -1) for layer in rows],
                                dim=1).numpy().tobytes()
            path = transfer_file(self.shm_dir, self.engine_id, export.key, self.rank)
            write_block_file(path, encode_block_file(bytes.fromhex(export.key), layout,
                                                     payload))

    def shutdown(self) -> None:
        self._queue.shutdown()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()   # (a transfer file is checked when the request is admitted)
