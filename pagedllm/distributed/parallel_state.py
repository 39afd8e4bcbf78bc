"""Process groups of one worker process: tensor-parallel (TP) and pipeline-parallel (PP).

Each worker process calls `init_distributed_environment` (torch.distributed's world, backend from
the platform: gloo on CPU, NCCL on CUDA) and then `initialize_model_parallel`, once, before the
model is built. Layers ask here for their rank and group size; without an initialised world every
getter answers "rank 0 of 1" and the collectives are identities (the single-process engine).

    global rank = pp_rank * tp_size + tp_rank

    tp=2, pp=2:   TP groups {0,1} {2,3}      PP groups {0,2} {1,3}
                  stage 0 = ranks 0,1 (first layers), stage 1 = ranks 2,3 (last layers + sampling)

NOTE(issue #11): the two groups are module state, set once per process at start-up and never per
step (the process *is* one rank); this is topology, not step state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupCoordinator:
    """One process group as seen from this process.

    Attributes:
        ranks: global ranks of the group, in group order.
        rank_in_group: this process's index in `ranks`.
        device_group: torch.distributed group for tensors on the model's device (gloo or NCCL).
        cpu_group: gloo group for CPU tensors and pickled objects (the same as `device_group` on
            CPU).
    """

    ranks: tuple[int, ...]
    rank_in_group: int
    device_group: object
    cpu_group: object

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x` (identity for a group of one)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's `x` along `dim` in rank order.

        x [..., d, ...] -> [..., world_size * d, ...]; all members pass the same shape.
        """
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite `x` on every member with `src`'s (`src` is a global rank); returns `x`."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.device_group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point send of a contiguous tensor to global rank `dst`."""
        dist.send(x.contiguous(), dst=dst, group=self.device_group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             src: int) -> torch.Tensor:
        """Receive a tensor of `shape`/`dtype` from global rank `src`."""
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=src, group=self.device_group)
        return x


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


@dataclass(frozen=True)
class ExpertParallelLayout:
    """How MoE layers place their experts (docs/moe.md).

    Attributes:
        enable_expert_parallel: experts split whole over the expert-parallel (EP) group, which
            is the tensor-parallel group; otherwise every TP rank holds a slice of every expert.
        num_redundant_experts: extra physical experts per MoE layer (EPLB replicas).
        count_expert_load: MoE layers count the tokens routed to each expert (EPLB on).
    """

    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0
    count_expert_load: bool = False


# NOTE(issue #19): topology like _TP/_PP: set by the model runner once, before it builds the
# model, read by `FusedMoE.__init__` only.
_EP_LAYOUT = ExpertParallelLayout()


def set_expert_parallel_layout(layout: ExpertParallelLayout) -> None:
    """Set the expert layout the MoE layers built after this call use."""
    global _EP_LAYOUT
    _EP_LAYOUT = layout


def get_expert_parallel_layout() -> ExpertParallelLayout:
    return _EP_LAYOUT


def _single() -> GroupCoordinator:
    return GroupCoordinator((0,), 0, None, None)


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str,
                                 backend: str, timeout_s: float | None = None) -> None:
    """Join torch.distributed's world (blocks until all `world_size` processes have joined).

    Args:
        distributed_init_method: e.g. "tcp://10.0.0.1:29500" or "env://" (MASTER_ADDR/PORT).
        backend: "gloo" or "nccl" (the platform's `dist_backend`).
        timeout_s: collective timeout; None = torch's default.

    Raises:
        RuntimeError: if a world of a different size is already initialised.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"torch.distributed already initialised with world size "
                               f"{dist.get_world_size()}, expected {world_size}")
        return
    kwargs = {}
    if timeout_s is not None:
        from datetime import timedelta
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, init_method=distributed_init_method,
                            world_size=world_size, rank=rank, **kwargs)


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int,
                              backend: str) -> None:
    """Create the TP and PP groups of the current world (every rank must call this).

    Raises:
        RuntimeError: if the world size is not tp * pp.
    """
    global _TP, _PP
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world != tensor_parallel_size * pipeline_parallel_size:
        raise RuntimeError(f"world size {world} != tensor_parallel_size {tensor_parallel_size} "
                           f"x pipeline_parallel_size {pipeline_parallel_size}")
    tp_groups = [tuple(range(p * tensor_parallel_size, (p + 1) * tensor_parallel_size))
                 for p in range(pipeline_parallel_size)]
    pp_groups = [tuple(range(t, world, tensor_parallel_size))
                 for t in range(tensor_parallel_size)]
    _TP = _make_coordinator(tp_groups, rank, backend)
    _PP = _make_coordinator(pp_groups, rank, backend)


def _make_coordinator(groups: list[tuple[int, ...]], rank: int,
                      backend: str) -> GroupCoordinator:
    # NOTE(issue #11): torch.distributed.new_group must be called by every rank for every group,
    # in the same order, even for groups the rank is not in.
    mine = None
    for ranks in groups:
        device_group = dist.new_group(list(ranks), backend=backend)
        cpu_group = device_group if backend == "gloo" else dist.new_group(list(ranks),
                                                                          backend="gloo")
        if rank in ranks:
            mine = GroupCoordinator(ranks, ranks.index(rank), device_group, cpu_group)
    assert mine is not None
    return mine


def destroy_model_parallel() -> None:
    """Leave the groups and the world (safe to call when none was initialised)."""
    global _TP, _PP
    _TP = _PP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _single()


def get_pp_group() -> GroupCoordinator:
    return _PP if _PP is not None else _single()


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    return get_pp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return get_pp_group().world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (identity for a group of one)."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate `x` over the tensor-parallel group along `dim` (identity for one rank)."""
    return get_tp_group().all_gather(x, dim)
