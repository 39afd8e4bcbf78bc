"""The worker side of a KV connector (vLLM's `KVConnectorBase_V1`, role WORKER), and the seams
at which the worker calls it in every step (`load_before_forward`, `save_after_forward`).

    Worker.execute_model(scheduler_output):
        bind_connector_metadata(scheduler_output.kv_connector_metadata)
        start_load_kv()                          transfers into the device cache start
        wait_for_layer_load(name) per layer      each layer's loads are complete
        ... the step's forward (and a multi-step round's later steps) ...
        save_kv_layer(name, kv_cache) per layer  each layer's blocks to save are handed over
        wait_for_save()                          the saves no longer read the device blocks
        clear_connector_metadata()
    get_finished(finished_req_ids)               requests whose asynchronous transfers ended

NOTE(kv_connector): vLLM calls `wait_for_layer_load` / `save_kv_layer` from inside each
attention layer, so transfers overlap the other layers' compute. Here the seams sit around the
whole forward: the CPU fused decoder runs every layer in one native call, and the forward
context is a frozen per-step object no layer may extend (DESIGN §2). A connector that transfers
asynchronously still overlaps its loads with the host's input preparation and its saves with the
scheduling of the next step.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import torch


class KVConnectorWorker(Protocol):
    """The worker side of a connector (one per rank)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The rank's KV tensors by layer name ([2, num_blocks, block_size, num_kv_heads,
        head_size] each); called again when they are reallocated (wake-up)."""

    def bind_connector_metadata(self, metadata: object) -> None: ...

    def clear_connector_metadata(self) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose saves finished, requests whose loads finished) since the last call:
        empty for a synchronous connector."""

    def set_model_fingerprint(self, fingerprint: str) -> None:
        """The weights changed (a weight update): what it stores from now on is marked with
        the new checkpoint's `model_fingerprint`."""

    def info(self) -> dict:
        """What the scheduler side needs of this rank (plain data): "num_tier_blocks" (blocks
        its host tier holds), and with a disk tier "layout" (the string its files carry) and
        "block_bytes" (one block's file)."""


def load_before_forward(connector: KVConnectorWorker, metadata: object,
                        layer_names: list[str]) -> None:
    """The seam before a step's forward (see the module docstring)."""
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv()
    for name in layer_names:
        connector.wait_for_layer_load(name)


def save_after_forward(connector: KVConnectorWorker, kv_caches: dict[str, torch.Tensor]) -> None:
    """The seam after a step's forward (and its multi-step round)."""
    for name, kv_layer in kv_caches.items():
        connector.save_kv_layer(name, kv_layer)
    connector.wait_for_save()
    connector.clear_connector_metadata()


def model_fingerprint(model_path: str) -> str:
    """A short digest of a checkpoint folder's identity (its config.json and the names, sizes
    and modification times of its weight files): stored KV of another model never matches."""
    folder = Path(model_path)
    h = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.gguf")):
        stat = path.stat()
        h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def kv_layout(kv_caches: dict[str, torch.Tensor], fingerprint: str, rank: int) -> str:
    """What a stored or transferred block of rank `rank` must say to be loaded there: the
    model's fingerprint (`model_fingerprint`), the rank, and each layer's name, dtype and block
    shape."""
    layers = ";".join(f"{name}:{str(c.dtype)[6:]}:{'x'.join(map(str, c.shape[2:]))}"
                      for name, c in kv_caches.items())
    return f"{fingerprint};rank{rank};{layers}"


def check_unquantized(connector: str, kv_caches: dict[str, torch.Tensor]) -> None:
    """Raises ValueError unless every KV tensor is [2, num_blocks, block_size, heads,
    head_size] (a quantized cache's scales share its allocation)."""
    for name, cache in kv_caches.items():
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(f"{connector}: layer {name}'s KV cache has shape "
                             f"{tuple(cache.shape)}; only unquantized caches "
                             "[2, blocks, block_size, heads, head_size] are supported")


def create_worker_connector(config, kv_caches: dict[str, torch.Tensor], bytes_per_block: int,
                            device: torch.device, rank: int = 0,
                            fingerprint: str = "") -> KVConnectorWorker:
    """The worker side of `config` (a `KVTransferConfig`) over this rank's KV tensors
    (`bytes_per_block`: one block over all of them) on global rank `rank`; `fingerprint`
    identifies the model's weights (`model_fingerprint`) in stored files.

    Raises:
        ValueError: an unknown connector, or settings it refuses.
    """
    if config.kv_connector == "OffloadingConnector":
        from pagedllm.worker.kv_connector.offloading import OffloadingConnectorWorker
        return OffloadingConnectorWorker(config.kv_connector_extra_config, kv_caches,
                                         bytes_per_block, device, rank, fingerprint)
    if config.kv_connector == "P2pShmConnector":
        from pagedllm.worker.kv_connector.p2p_shm import P2pShmConnectorWorker
        return P2pShmConnectorWorker(config, kv_caches, bytes_per_block, device, rank,
                                     fingerprint)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}")
