"""The P2pShmConnector's worker side: a producer rank writes a prompt's blocks to a shared-memory
file after the forward that computed them; a consumer rank reads a pulled file into fresh device
blocks before its forward and deletes it (core/kv_connector/p2p_shm.py orders both).

A file is disk_tier.py's format with the request's digest as its hash and, as payload, the
blocks in order, each block every layer's K and V ([2, block_size, num_kv_heads, head_size]
raw bytes, layer order), so blocks [first, first + n) are one contiguous slice:

    payload = | block 0: layer 0 K V | layer 1 K V | ... | block 1: ... | ... |
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.kv_connector.disk_tier import encode_block_file, write_block_file
from pagedllm.core.kv_connector.p2p_shm import P2pShmMetadata, engine_id_of, shm_dir_of
from pagedllm.core.kv_connector.p2p_transport import read_transfer_header, transfer_file
from pagedllm.worker.kv_connector.base import check_unquantized, kv_layout


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

    def start_load_kv(self) -> None:
        """Read each pulled file into its device blocks (synchronously: the forward that
        follows reads them), then delete it.

        Raises:
            RuntimeError: a file vanished or changed after the scheduler side checked it.
        """
        if self._meta is None:
            return
        layout = self.layout()
        for load in self._meta.loads:
            path = transfer_file(self.shm_dir, load.engine_id, load.key, self.rank)
            offset, problem = read_transfer_header(path, load.key, layout)
            n = len(load.block_ids)
            start = offset + load.first_block * self.bytes_per_block
            if problem is None and path.stat().st_size < start + n * self.bytes_per_block:
                problem = f"{path} is too short"
            if problem is not None:
                raise RuntimeError(f"KV transfer: {problem} (after it was pulled)")
            # [n, bytes_per_block]: each block's layers, K and V (the module docstring).
            raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=n * self.bytes_per_block,
                                               offset=start)).view(n, self.bytes_per_block)
            block_ids = torch.tensor(load.block_ids, dtype=torch.int64, device=self.device)
            column = 0
            for cache in self._kv_caches.values():
                shape = (n, 2) + tuple(cache.shape[2:])
                layer_bytes = cache[:, 0].numel() * cache.element_size()
                rows = raw[:, column:column + layer_bytes].contiguous().view(cache.dtype)
                cache[:, block_ids] = rows.view(shape).transpose(0, 1).to(self.device)
                column += layer_bytes
            path.unlink(missing_ok=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` copied every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Take this layer's blocks of the step's exports to the host."""
        if self._meta is None or not self._meta.exports:
            return
        self._rows[layer_name] = [
            kv_layer[:, torch.tensor(e.block_ids, dtype=torch.int64, device=self.device)]
            .transpose(0, 1).to("cpu").contiguous() for e in self._meta.exports]

    def wait_for_save(self) -> None:
        """Write each export's file (atomically: a temporary name, then a rename)."""
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()
