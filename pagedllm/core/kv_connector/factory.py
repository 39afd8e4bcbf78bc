"""Connector name -> scheduler-side class (the worker side: pagedllm/worker/kv_connector/)."""

from __future__ import annotations

from pagedllm.core.kv_connector.base import KVConnectorScheduler

# The known connector names (`KVTransferConfig.kv_connector`).
CONNECTORS = ("OffloadingConnector",)


def create_scheduler_connector(config, block_size: int, num_tier_blocks: int
                               ) -> KVConnectorScheduler:
    """The scheduler side of `config` (a `KVTransferConfig`); `num_tier_blocks` is how many
    blocks the workers' tier holds (the minimum over the ranks).

    Raises:
        ValueError: an unknown connector (the config refuses it first).
    """
    if config.kv_connector == "OffloadingConnector":
        from pagedllm.core.kv_connector.offloading import OffloadingConnectorScheduler
        return OffloadingConnectorScheduler(block_size, num_tier_blocks, config.kv_role)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {list(CONNECTORS)}")
