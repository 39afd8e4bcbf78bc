"""The worker side of a KV connector (vLLM's `KVConnectorBase_V1`, role WORKER), and the seams
at which the worker and its layers call it in every step (`start_step`, `KVLayerHooks`,
`finish_step`):

    Worker.execute_model(scheduler_output):
        bind_connector_metadata(scheduler_output.kv_connector_metadata)
        start_load_kv()                          every layer's loads are queued, in layer order
        forward, in each attention layer i (layers/attention.py, via the forward context):
            wait_for_layer_load(layer i)         only layer i's loads must have landed
            ... attention i writes the step's K/V and attends ...
            save_kv_layer(layer i, kv_cache)     layer i's saves are queued
        ... (a multi-step round's later steps; its saves wait for the round's end) ...
        wait_for_save()                          the saves no longer read the device blocks
        clear_connector_metadata()
    get_finished(finished_req_ids)               requests whose asynchronous transfers ended

A forward that does not run the layers' Python code (a CUDA graph replay, the CPU fused
decoder's one native call over every layer, a drafter's model) waits for all loads before it
starts; saves a forward did not hand over are handed over at the step's end. A connector whose
transfers run in the background (worker/kv_connector/async_copy.py) thus overlaps layer i's
loads and saves with the other layers' compute, as vLLM's per-layer connector calls do.
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

    def shutdown(self) -> None:
        """Finish queued transfers and stop background threads (the worker shuts down)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose saves finished, requests whose loads finished) since the last call:
        empty for a synchronous connector."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids whose loads failed since the last call (vLLM's name; called after
        `wait_for_save`): they hold zeros, and the scheduler recomputes them."""

    def set_model_fingerprint(self, fingerprint: str) -> None:
        """The weights changed (a weight update): what it stores from now on is marked with
        the new checkpoint's `model_fingerprint`."""

    def info(self) -> dict:
        """What the scheduler side needs of this rank (plain data): "num_tier_blocks" (blocks
        its host tier holds), and with a disk tier "layout" (the string its files carry) and
        "block_bytes" (one block's file)."""


class KVLayerHooks:
    """One step's per-layer seams, carried to the attention layers by the forward context
    (`ForwardContext.kv_hooks`). Each layer's load is waited for and its save handed over once
    per step, however many forwards call them.

    Args:
        connector: the rank's connector, bound to the step's metadata.
        layer_names: its layers, in model order.
        save_in_forward: whether a layer's save may start right after the first forward wrote
            it (False for a multi-step round, whose later steps write more of its blocks).
    """

    def __init__(self, connector: KVConnectorWorker, layer_names: list[str],
                 save_in_forward: bool) -> None:
        self.connector = connector
        self._unloaded = dict.fromkeys(layer_names)   # (ordered: layer order)
        self._saved: set[str] = set()
        self.save_in_forward = save_in_forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer `layer_name` reads its KV cache."""
        if layer_name in self._unloaded:
            del self._unloaded[layer_name]
            self.connector.wait_for_layer_load(layer_name)

    def wait_for_all_loads(self) -> None:
        """Before a forward that does not call the layers' hooks (module docstring)."""
        for name in list(self._unloaded):
            self.wait_for_layer_load(name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """After layer `layer_name` wrote the step's K/V into `kv_layer` ([2, num_blocks,
        block_size, num_kv_heads, head_size])."""
        if self.save_in_forward and layer_name not in self._saved:
            self._saved.add(layer_name)
            self.connector.save_kv_layer(layer_name, kv_layer)

    def finish(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The step's end: loads no forward waited for (a step with nothing to compute, every
        request aborted), the saves no forward handed over, then `wait_for_save`."""
        self.wait_for_all_loads()
        for name, kv_layer in kv_caches.items():
            if name not in self._saved:
                self._saved.add(name)
                self.connector.save_kv_layer(name, kv_layer)
        self.connector.wait_for_save()


def start_step(connector: KVConnectorWorker, metadata: object, layer_names: list[str],
               save_in_forward: bool = True) -> KVLayerHooks:
    """The seam before a step's forward: binds the step's metadata and starts its loads;
    returns the hooks its forward calls (`KVLayerHooks`)."""
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv()
    return KVLayerHooks(connector, layer_names, save_in_forward)


def finish_step(hooks: KVLayerHooks, kv_caches: dict[str, torch.Tensor]) -> None:
    """The seam after a step's forward (and its multi-step round): `KVLayerHooks.finish`,
    and the metadata is cleared even when a transfer failed."""
    try:
        hooks.finish(kv_caches)
    finally:
        hooks.connector.clear_connector_metadata()


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


def block_row_columns(kv_caches: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Each layer's byte range in one block's row of the packed block layout that block files
    and transfer files use: a block's row is every layer's K and V of it, in layer order."""
    columns, offset = {}, 0
    for name, cache in kv_caches.items():
        size = cache[:, 0].numel() * cache.element_size()
        columns[name] = (offset, offset + size)
        offset += size
    return columns


def copy_rows_to_layer(cache: torch.Tensor, block_ids: list[int], rows: torch.Tensor,
                       column: tuple[int, int]) -> None:
    """cache[:, block_ids[i]] <- bytes `column` of rows[i] (`rows`: [n, bytes per block] uint8
    on the host, the packed block layout of `block_row_columns`; `cache`: one layer's
    [2, num_blocks, block_size, num_kv_heads, head_size])."""
    shape = (len(block_ids), 2) + tuple(cache.shape[2:])
    layer = rows[:, column[0]:column[1]].contiguous().view(cache.dtype).view(shape)
    index = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    cache[:, index] = layer.transpose(0, 1).to(cache.device)


def check_unquantized(connector: str, kv_caches: dict[str, torch.Tensor]) -> None:
    """Raises ValueError unless every KV tensor is an unquantized [2, num_blocks, block_size,
    heads, head_size] cache: the connectors copy K/V values only, and a quantized cache
    (`kv_cache_dtype` int8/fp8) keeps its scales in the same allocation, past the view
    (kv_cache_layout.py), so they would not travel with the blocks."""
    from pagedllm.kv_cache_layout import is_quantized_kv_cache
    for name, cache in kv_caches.items():
        if is_quantized_kv_cache(cache):
            raise ValueError(f"{connector}: layer {name}'s KV cache is quantized "
                             f"({cache.dtype}, kv_cache_dtype int8/fp8); the connector does "
                             "not carry its scales: use kv_cache_dtype='auto'")
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
