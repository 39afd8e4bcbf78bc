"""The OffloadingConnector's worker side: the host-memory tier's bytes (one tensor per layer,
[2, num_slots, block_size, num_kv_heads, head_size], the layout of a device block), and the
copies between it and the device cache that the scheduler side orders by slot number
(core/kv_connector/offloading.py). On CUDA the tier is pinned host memory; on the CPU it is
ordinary memory too (a separate, larger budget than the device cache's, on the same code path).
"""

from __future__ import annotations

import torch

from pagedllm.core.kv_connector.disk_tier import (block_file, decode_block_file,
                                                  encode_block_file, make_tier_folder,
                                                  write_block_file)
from pagedllm.core.kv_connector.offloading import OffloadingMetadata
from pagedllm.worker.kv_connector.base import check_unquantized, kv_layout

GiB = 1 << 30


class OffloadingConnectorWorker:
    """See the module docstring.

    Args:
        extra_config: `kv_offloading_size` (GiB, > 0): the host tier's budget on this rank;
            `kv_offloading_dir`: the disk tier's folder (core/kv_connector/disk_tier.py).
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
        if not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"OffloadingConnector: kv_offloading_size must be a number of GiB "
                             f"> 0, got {size!r}")
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

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        check_unquantized("OffloadingConnector", kv_caches)
        for name, cache in kv_caches.items():
            shape = (2, self.num_slots) + tuple(cache.shape[2:])
            host = self._host.get(name)
            if host is None or host.shape != shape or host.dtype != cache.dtype:
                self._host[name] = torch.zeros(shape, dtype=cache.dtype, pin_memory=self._pin)
        self._kv_caches = dict(kv_caches)

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

    def start_load_kv(self) -> None:
        """Copy every layer's loaded slots into their device blocks (synchronously: the
        forward that follows reads them)."""
        meta = self._meta
        if meta is None:
            return
        if meta.load_slots:
            slots = torch.tensor(meta.load_slots, dtype=torch.int64)
            blocks = torch.tensor(meta.load_block_ids, dtype=torch.int64, device=self.device)
            for name, cache in self._kv_caches.items():
                cache[:, blocks] = self._host[name][:, slots].to(self.device, non_blocking=True)
        for block_id, block_hash in zip(meta.disk_load_block_ids, meta.disk_load_hashes):
            self._load_block_file(block_id, block_hash)

    def _load_block_file(self, block_id: int, block_hash: bytes) -> None:
        """Fill device block `block_id` from its file (checked by the scheduler side when it
        matched; the header and size are checked again here).

        Raises:
            RuntimeError: the file changed since it was matched (deleted or rewritten by
                something else): the step cannot proceed with a wrong block.
        """
        path = block_file(self.disk_dir, block_hash, self.rank)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise RuntimeError(f"KV disk tier: {path} vanished after it was matched: {e}") from e
        payload = decode_block_file(data, block_hash, self.layout(), check_crc=False)
        if payload is None:
            raise RuntimeError(f"KV disk tier: {path} changed after it was matched")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for cache in self._kv_caches.values():
            block = cache[:, block_id]
            n = block.numel() * block.element_size()
            block.copy_(raw[offset:offset + n].view(cache.dtype).view(block.shape))
            offset += n

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` copied every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy the step's stored blocks of this layer into their tier slots."""
        meta = self._meta
        if meta is None:
            return
        if meta.store_slots:
            blocks = torch.tensor(meta.store_block_ids, dtype=torch.int64, device=self.device)
            slots = torch.tensor(meta.store_slots, dtype=torch.int64)
            self._host[layer_name][:, slots] = kv_layer[:, blocks].to("cpu")
        if meta.disk_store_hashes:
            blocks = torch.tensor(meta.disk_store_block_ids, dtype=torch.int64,
                                  device=self.device)
            # [n, 2, block_size, heads, head_size]: each block's K and V together
            self._disk_rows[layer_name] = kv_layer[:, blocks].transpose(0, 1).to("cpu")

    def wait_for_save(self) -> None:
        """Write the step's disk stores (each block's file holds every layer); the copies of
        `save_kv_layer` are blocking."""
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()
