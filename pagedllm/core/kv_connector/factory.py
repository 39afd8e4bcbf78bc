"""Connector name -> scheduler-side class (the worker side: pagedllm/worker/kv_connector/)."""

from __future__ import annotations

from pagedllm.core.kv_connector.base import KVConnectorScheduler

# The known connector names (`KVTransferConfig.kv_connector`).
CONNECTORS = ("OffloadingConnector",)
# The disk tier's budget when `kv_offloading_dir` is given without `kv_offloading_disk_size`.
DEFAULT_DISK_GIB = 16.0


def create_scheduler_connector(config, block_size: int, worker_infos: list[dict]
                               ) -> KVConnectorScheduler:
    """The scheduler side of `config` (a `KVTransferConfig`) given what each rank's worker side
    reported (`KVConnectorWorker.info()`: "num_tier_blocks", and for a disk tier "layout" and
    "block_bytes").

    Raises:
        ValueError: an unknown connector (the config refuses it first), or a bad disk tier
            setting (`kv_offloading_disk_size` not a positive number of GiB).
    """
    if config.kv_connector == "OffloadingConnector":
        from pagedllm.core.kv_connector.disk_tier import DiskTierIndex
        from pagedllm.core.kv_connector.offloading import OffloadingConnectorScheduler
        extra = config.kv_connector_extra_config
        disk = None
        if extra.get("kv_offloading_dir"):
            size = extra.get("kv_offloading_disk_size", DEFAULT_DISK_GIB)
            if not isinstance(size, (int, float)) or not size > 0:
                raise ValueError(f"OffloadingConnector: kv_offloading_disk_size must be a "
                                 f"number of GiB > 0, got {size!r}")
            disk = DiskTierIndex(extra["kv_offloading_dir"],
                                 [info["layout"] for info in worker_infos], int(size * 2**30))
        return OffloadingConnectorScheduler(
            block_size, min(info["num_tier_blocks"] for info in worker_infos), config.kv_role,
            disk, sum(info.get("block_bytes", 0) for info in worker_infos))
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {list(CONNECTORS)}")
