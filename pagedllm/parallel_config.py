"""Parallel layout configs: `ParallelConfig` (tensor and pipeline parallel sizes, executor backend, CPU
binding) and `EPLBConfig`, and the check that a model splits over the layout.

Split out of `pagedllm.config` (which re-exports both classes); see docs/distributed.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class EPLBConfig:
    """Expert-parallel load balancing (vLLM's `eplb_config`; see docs/moe.md).

    Attributes:
        window_size: engine steps whose expert loads are summed for a rebalance.
        step_interval: rebalance every this many engine steps (with a forward).
        num_redundant_experts: extra physical experts per MoE layer (replicas of hot ones).
    """

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"eplb_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_redundant_experts < 0:
            raise ValueError("eplb_config.num_redundant_experts must be >= 0, got "
                             f"{self.num_redundant_experts}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EPLBConfig:
        """Raises ValueError for keys that are not fields."""
        unknown = set(d) - {"window_size", "step_interval", "num_redundant_experts"}
        if unknown:
            raise ValueError(f"eplb_config: unknown keys {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout (see docs/distributed.md).

    Attributes:
        tensor_parallel_size: ranks that split every layer's heads / hidden units.
        pipeline_parallel_size: stages that split the layers.
        distributed_executor_backend: "uni" (one process, world size 1), "mp" (one worker process
            per rank on this machine) or "ray" (Ray actors, one machine or a cluster); None picks
            "uni" for a world of 1 and "mp" otherwise.
        nnodes, node_rank: `mp` across machines: the ranks are split evenly over `nnodes`
            machines, node `node_rank` runs ranks [node_rank * L, (node_rank + 1) * L) with
            L = world_size / nnodes; node 0 runs the engine, the others `pagedllm worker`.
        master_addr, master_port: torch.distributed rendezvous of rank 0 (default: the
            MASTER_ADDR / MASTER_PORT environment variables; 127.0.0.1 and a free port on one
            machine). Needed when nnodes > 1.
        enable_expert_parallel: MoE experts split whole over the tensor-parallel ranks
            instead of sharding every expert (docs/moe.md).
        enable_eplb, eplb_config: rebalance experts over those ranks while serving.
        cpu_threads_bind: CPU platform: "auto" (one machine's worker processes on disjoint
            cores, a NUMA node each where there are enough), "nobind", or each process's CPUs
            in vLLM's format ("0-15|16-31", one list per process on this machine).
        cpu_reserved_cores: CPU platform: physical cores kept from the kernels for the API
            server's threads (None: one where a machine allows at least 8 cores; see
            docs/shared_machines.md).
        data_parallel_size_local, data_parallel_rank_local: engine replicas of one data-
            parallel server in their own processes on this machine, and this engine's index
            among them (vLLM's names): each replica's workers take their own share of the
            machine (`machine_slot`) instead of all planning as the machine's only processes.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    eplb_config: EPLBConfig = EPLBConfig()
    cpu_threads_bind: str = "auto"
    cpu_reserved_cores: int | None = 0
    data_parallel_size_local: int = 1
    data_parallel_rank_local: int = 0

    def __post_init__(self) -> None:
        if self.data_parallel_size_local < 1 or not 0 <= self.data_parallel_rank_local \
                < self.data_parallel_size_local:
            raise ValueError(f"need data_parallel_size_local >= 1 and 0 <= "
                             f"data_parallel_rank_local < data_parallel_size_local, got "
                             f"{self.data_parallel_size_local} and "
                             f"{self.data_parallel_rank_local}")
        if self.cpu_reserved_cores is not None and self.cpu_reserved_cores < 0:
            raise ValueError(f"cpu_reserved_cores must be >= 0, got {self.cpu_reserved_cores}")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel")
        if self.eplb_config.num_redundant_experts and not self.enable_eplb:
            raise ValueError("eplb_config.num_redundant_experts > 0 needs enable_eplb")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if self.world_size == 1 else "mp"
            object.__setattr__(self, "distributed_executor_backend", backend)
        if backend not in _EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {_EXECUTOR_BACKENDS}, "
                             f"got {backend!r}")
        if backend == "uni" and self.world_size != 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one process; "
                             f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} "
                             "needs 'mp' or 'ray'")
        if self.master_addr is None:
            object.__setattr__(self, "master_addr", os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if self.master_port is None and os.environ.get("MASTER_PORT"):
            object.__setattr__(self, "master_port", int(os.environ["MASTER_PORT"]))
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes "
                             f"{self.nnodes}, node_rank {self.node_rank}")
        if self.nnodes > 1:
            if backend != "mp":
                raise ValueError("nnodes > 1 is for distributed_executor_backend 'mp' (Ray "
                                 f"places its workers itself), got {backend!r}")
            if self.world_size % self.nnodes:
                raise ValueError(f"world size {self.world_size} (tensor_parallel_size x "
                                 f"pipeline_parallel_size) is not divisible by nnodes "
                                 f"{self.nnodes}")
            if self.master_port is None:
                raise ValueError("nnodes > 1 needs master_port (or MASTER_PORT) and master_addr "
                                 "(or MASTER_ADDR): rank 0's address, reachable from every node")
        self._check_cpu_threads_bind(backend)

    def machine_slot(self, local_rank: int, local_world_size: int) -> tuple[int, int]:
        """(index, count) of worker `local_rank` of this engine's `local_world_size` processes
        on this machine among all the worker processes there, the other local data-parallel
        replicas' included: replica r's workers come after those of replicas 0..r-1."""
        return (self.data_parallel_rank_local * local_world_size + local_rank,
                self.data_parallel_size_local * local_world_size)

    def _check_cpu_threads_bind(self, backend: str) -> None:
        """cpu_threads_bind parses, and (where this machine's processes are known: not Ray)
        gives one CPU list per process of this machine, of CPUs this process may use (one
        machine) - refused here rather than by each worker."""
        from pagedllm.platforms.cpu_topology import (allowed_cpus, check_threads_bind,
                                                     parse_threads_bind)

        if backend == "ray":
            parse_threads_bind(self.cpu_threads_bind)     # raises ValueError naming it
            return
        per_node = self.world_size // self.nnodes * self.data_parallel_size_local
        check_threads_bind(self.cpu_threads_bind, per_node,
                           f"the {per_node} process(es) of this machine (tensor_parallel_size "
                           "x pipeline_parallel_size / nnodes x the local data-parallel "
                           "replicas)", allowed_cpus() if self.nnodes == 1 else None)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def validate_parallel_layout(hf: dict[str, Any], pc: ParallelConfig) -> None:
    """Check that the model splits over the layout before any process starts.

    Raises:
        ValueError: naming the config field and the model dimension that does not divide.
    """
    text = hf.get("text_config", hf)
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {heads} "
                         "attention heads")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} must divide, or be a multiple of, the "
                         f"model's {kv_heads} KV heads")
    inter = text.get("intermediate_size")
    if inter is not None and int(inter) % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's "
                         f"intermediate_size {inter}")
    if pc.enable_expert_parallel:
        experts = (text.get("num_local_experts") or text.get("num_experts")
                   or text.get("n_routed_experts"))   # (DeepSeek / GLM-4 MoE's name)
        if not experts:
            raise ValueError("enable_expert_parallel needs a mixture-of-experts model; the "
                             "config has no num_local_experts / num_experts / n_routed_experts")
        physical = int(experts) + pc.eplb_config.num_redundant_experts
        if physical % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the {physical} physical "
                             f"experts ({experts} + eplb_config.num_redundant_experts "
                             f"{pc.eplb_config.num_redundant_experts}) of expert parallelism")
    layers = int(text.get("num_hidden_layers", 1))
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {layers} layers")
