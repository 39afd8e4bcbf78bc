"""KV connector config: `KVTransferConfig` (vLLM's `--kv-transfer-config`) and how the engine
arguments `kv_transfer_config` / `kv_offloading_size` / `kv_offloading_dir` resolve to one.

Split out of `pagedllm.config` (which re-exports the public names); see docs/kv_connectors.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (vLLM's `KVTransferConfig`, `--kv-transfer-config` JSON; see
    docs/kv_connectors.md).

    Attributes:
        kv_connector: the connector's name (`pagedllm.core.kv_connector.factory.CONNECTORS`).
        kv_role: "kv_producer" (saves KV), "kv_consumer" (loads KV) or "kv_both".
        kv_connector_extra_config: the connector's own settings (e.g. OffloadingConnector's
            `kv_offloading_size` in GiB).
        engine_id: this engine's id among the connector's peers (None: not needed).
        kv_ip, kv_port: the prefill instance's transfer endpoint (P2pShmConnector: where a
            kv_producer binds and the only peer a kv_consumer pulls from).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579

    def __post_init__(self) -> None:
        from pagedllm.core.kv_connector.factory import validate_transfer_config
        validate_transfer_config(self)
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {list(KV_ROLES)}, got "
                             f"{self.kv_role!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        """Raises ValueError naming unknown keys or a missing `kv_connector`."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}")
        if "kv_connector" not in values:
            raise ValueError("kv_transfer_config: kv_connector is required")
        return cls(**values)


def check_offloading_size(size: Any, name: str = "kv_offloading_size") -> None:
    """Raises ValueError unless `size` (GiB) is a finite number > 0 (a bool is not one)."""
    if isinstance(size, bool) or not isinstance(size, (int, float)) \
            or not math.isfinite(size) or not size > 0:
        raise ValueError(f"{name} must be a finite number of GiB > 0, got {size!r}")


def resolve_kv_transfer_config(config: dict[str, Any] | KVTransferConfig | None,
                                kv_offloading_size: float | None,
                                kv_offloading_dir: str | None,
                                enable_prefix_caching: bool) -> KVTransferConfig | None:
    """The engine's KV connector: `config` as given, or for `kv_offloading_size` (GiB, vLLM's
    `--kv-offloading-size`) the OffloadingConnector with that host tier (and a disk tier in
    `kv_offloading_dir`).

    Raises:
        ValueError: both given, a bad size, a connector that needs prefix caching without it,
            or an invalid config (naming the key).
        TypeError: `config` is neither a dict nor a KVTransferConfig.
    """
    if isinstance(config, dict):
        config = KVTransferConfig.from_dict(config)
    elif config is not None and not isinstance(config, KVTransferConfig):
        raise TypeError(f"kv_transfer_config must be a dict or a KVTransferConfig, got "
                        f"{type(config).__name__} {config!r}")
    if kv_offloading_size is not None:
        if config is not None:
            raise ValueError("give kv_offloading_size or kv_transfer_config, not both")
        check_offloading_size(kv_offloading_size)
        extra: dict[str, Any] = {"kv_offloading_size": float(kv_offloading_size)}
        if kv_offloading_dir is not None:
            extra["kv_offloading_dir"] = str(kv_offloading_dir)
        config = KVTransferConfig("OffloadingConnector", "kv_both", extra)
    elif kv_offloading_dir is not None:
        raise ValueError("kv_offloading_dir goes with kv_offloading_size (the host tier it "
                         "backs), or inside kv_transfer_config's kv_connector_extra_config")
    if config is not None and config.kv_connector == "OffloadingConnector" \
            and not enable_prefix_caching:
        raise ValueError("the OffloadingConnector keys blocks by their prefix hashes: it needs "
                         "enable_prefix_caching=True")
    return config
