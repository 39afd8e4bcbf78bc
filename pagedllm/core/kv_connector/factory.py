"""Connector name -> scheduler-side class (the worker side: pagedllm/worker/kv_connector/)."""

from __future__ import annotations

from pagedllm.core.kv_connector.base import KVConnectorScheduler

# The known connector names (`KVTransferConfig.kv_connector`).
CONNECTORS = ("OffloadingConnector", "P2pShmConnector")
# P2pShmConnector's kv_connector_extra_config keys and their defaults (docs/kv_connectors.md).
P2P_SHM_DEFAULTS = {"kv_peer_ip": "127.0.0.1", "transfer_timeout": 30.0, "transfer_ttl": 120.0,
                    "shm_dir": "/dev/shm"}
# Each connector's kv_connector_extra_config keys.
# (`async_transfers`, both: the workers' copies run on a background thread; default true.)
EXTRA_KEYS = {"OffloadingConnector": ("kv_offloading_size", "kv_offloading_dir",
                                      "kv_offloading_disk_size", "async_transfers"),
              "P2pShmConnector": tuple(P2P_SHM_DEFAULTS) + ("async_transfers",)}


def validate_transfer_config(config) -> None:
    """Check a `KVTransferConfig` against its connector.

    Raises:
        ValueError: naming an unknown connector, an unknown kv_connector_extra_config key, or
            a bad value (an OffloadingConnector size that is not a finite number of GiB > 0,
            an `async_transfers` that is not a bool, a P2pShmConnector role other than
            kv_producer/kv_consumer, a port outside 1-65535, an unsafe engine_id, a timeout
            that is not a positive number).
    """
    if config.kv_connector not in CONNECTORS:
        raise ValueError(f"kv_transfer_config: unknown kv_connector {config.kv_connector!r}; "
                         f"known: {sorted(CONNECTORS)}")
    extra = config.kv_connector_extra_config
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
    known = EXTRA_KEYS[config.kv_connector]
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown kv_connector_extra_config keys {unknown} "
                         f"for {config.kv_connector}; known: {list(known)}")
    if config.kv_connector == "OffloadingConnector":
        from pagedllm.config import check_offloading_size
        for name in ("kv_offloading_size", "kv_offloading_disk_size"):
            if name in extra:
                check_offloading_size(extra[name], f"kv_transfer_config: {name}")
    if not isinstance(extra.get("async_transfers", True), bool):
        raise ValueError(f"kv_transfer_config: async_transfers must be true or false, got "
                         f"{extra['async_transfers']!r}")
    if config.kv_connector != "P2pShmConnector":
        return
    from pagedllm.core.kv_connector.p2p_transport import check_engine_id
    if config.kv_role not in ("kv_producer", "kv_consumer"):
        raise ValueError(f"kv_transfer_config: P2pShmConnector's kv_role must be kv_producer "
                         f"(prefill) or kv_consumer (decode), got {config.kv_role!r}")
    if isinstance(config.kv_port, bool) or not isinstance(config.kv_port, int) \
            or not 1 <= config.kv_port <= 65535:
        raise ValueError(f"kv_transfer_config: kv_port must be a port in 1-65535, got "
                         f"{config.kv_port!r}")
    for name in ("kv_ip",):
        if not isinstance(getattr(config, name), str) or not getattr(config, name):
            raise ValueError(f"kv_transfer_config: {name} must be a host address")
    if config.engine_id is not None:
        check_engine_id(config.engine_id, "kv_transfer_config: engine_id")
    for name in ("transfer_timeout", "transfer_ttl"):
        value = extra.get(name, P2P_SHM_DEFAULTS[name])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"kv_transfer_config: {name} must be a number of seconds > 0, got "
                             f"{value!r}")
    for name in ("kv_peer_ip", "shm_dir"):
        if not isinstance(extra.get(name, ""), str):
            raise ValueError(f"kv_transfer_config: {name} must be a string")
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
    if config.kv_connector == "P2pShmConnector":
        from pagedllm.core.kv_connector.p2p_shm import (P2pShmConsumerScheduler,
                                                        P2pShmProducerScheduler)
        cls = (P2pShmProducerScheduler if config.kv_role == "kv_producer"
               else P2pShmConsumerScheduler)
        return cls(config, block_size, [info["layout"] for info in worker_infos])
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {list(CONNECTORS)}")
