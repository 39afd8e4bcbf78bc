"""The OffloadingConnector's worker side: the host-memory tier's bytes (one tensor per layer,
[2, num_slots, block_size, num_kv_heads, head_size], the layout of a device block), and the
copies between it and the device cache that the scheduler side orders by slot number
(core/kv_connector/offloading.py). On CUDA the tier is pinned host memory; on the CPU it is
ordinary memory too (a separate, larger budget than the device cache's, on the same code path).
"""

from __future__ import annotations

import torch

from pagedllm.core.kv_connector.offloading import OffloadingMetadata

GiB = 1 << 30


class OffloadingConnectorWorker:
    """See the module docstring.

    Args:
        extra_config: `kv_offloading_size` (GiB, > 0): the tier's budget on this rank.
        kv_caches: this rank's KV tensors by layer name.
        bytes_per_block: one block over all of them.
        device: the KV cache's device.

    Raises:
        ValueError: a missing or bad size, a quantized KV cache (its scales share the
            allocation), or a budget under one block.
    """

    def __init__(self, extra_config: dict, kv_caches: dict[str, torch.Tensor],
                 bytes_per_block: int, device: torch.device) -> None:
        size = extra_config.get("kv_offloading_size")
        if not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"OffloadingConnector: kv_offloading_size must be a number of GiB "
                             f"> 0, got {size!r}")
        self.num_slots = int(size * GiB) // bytes_per_block
        if self.num_slots < 1:
            raise ValueError(f"OffloadingConnector: {size} GiB holds no block of "
                             f"{bytes_per_block} bytes")
        self.device = device
        self._pin = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self.register_kv_caches(kv_caches)
        self._meta: OffloadingMetadata | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            if cache.dim() != 5 or cache.shape[0] != 2:
                raise ValueError(f"OffloadingConnector: layer {name}'s KV cache has shape "
                                 f"{tuple(cache.shape)}; only unquantized caches "
                                 "[2, blocks, block_size, heads, head_size] are supported")
            shape = (2, self.num_slots) + tuple(cache.shape[2:])
            host = self._host.get(name)
            if host is None or host.shape != shape or host.dtype != cache.dtype:
                self._host[name] = torch.zeros(shape, dtype=cache.dtype, pin_memory=self._pin)
        self._kv_caches = dict(kv_caches)

    def num_tier_blocks(self) -> int:
        return self.num_slots

    def bind_connector_metadata(self, metadata: object) -> None:
        self._meta = metadata if isinstance(metadata, OffloadingMetadata) else None

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Copy every layer's loaded slots into their device blocks (synchronously: the
        forward that follows reads them)."""
        meta = self._meta
        if meta is None or not meta.load_slots:
            return
        slots = torch.tensor(meta.load_slots, dtype=torch.int64)
        blocks = torch.tensor(meta.load_block_ids, dtype=torch.int64, device=self.device)
        for name, cache in self._kv_caches.items():
            cache[:, blocks] = self._host[name][:, slots].to(self.device, non_blocking=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` copied every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy the step's stored blocks of this layer into their tier slots."""
        meta = self._meta
        if meta is None or not meta.store_slots:
            return
        blocks = torch.tensor(meta.store_block_ids, dtype=torch.int64, device=self.device)
        slots = torch.tensor(meta.store_slots, dtype=torch.int64)
        self._host[layer_name][:, slots] = kv_layer[:, blocks].to("cpu")

    def wait_for_save(self) -> None:
        """The copies of `save_kv_layer` are blocking: done."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()
