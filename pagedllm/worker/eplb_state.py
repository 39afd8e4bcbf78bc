"""EplbState: the worker side of expert-parallel load balancing (EPLB).

Owns the sliding window of per-layer expert loads and, every `step_interval` steps, applies
a new placement from the pure-numpy policy (distributed/eplb/policy.py) to this stage's
`FusedMoE` layers, between two engine steps:

    after each step with a forward:   window[step % window_size] = each layer's take_expert_load()
    every step_interval steps:        loads = window.sum() all-reduced over the EP group
                                      placement = rebalance_experts(loads, ep_size, R)
                                      per layer: the slots whose expert changes take it from a
                                      copy on their rank or point-to-point from another; set maps

Every rank of the EP (= TP) group runs the same steps on the same loads (the all-reduce makes
them identical even if routing ever differed), so all ranks reach the same plan. It never
decides scheduling and never touches requests: running requests see the new weights at the
next step and produce the same outputs (each expert's weights are only moved, not changed).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pagedllm.config import EPLBConfig
from pagedllm.core.sched_output import EplbStats
from pagedllm.distributed.eplb.policy import (ExpertPlacement, imbalance,
                                              placement_from_physical_to_logical,
                                              plan_expert_moves, rank_loads,
                                              rebalance_experts)
from pagedllm.distributed.parallel_state import GroupCoordinator, get_tp_group
from pagedllm.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)


class EplbState:
    """Expert-load window and rebalancing of a list of MoE layers.

    Args:
        layers: this pipeline stage's `FusedMoE` layers (built with `count_expert_load`), all
            with the same expert counts.
        config: window_size, step_interval, num_redundant_experts.
        ep_group: the expert-parallel group (the TP group under expert parallelism).
        layer_ids: the decoder-layer index of each of `layers` (default 0, 1, ...), for the
            reported stats.

    Attributes:
        imbalance_before, imbalance_after: [num_layers] float64 load imbalance (max / mean over
            EP ranks) of the window's loads under the old and the new placement at the last
            rebalance (None before the first).

    Raises:
        ValueError: for no layers, layers of different expert counts, layers without load
            counting, or `layer_ids` of another length than `layers`.
    """

    def __init__(self, layers: list[FusedMoE], config: EPLBConfig,
                 ep_group: GroupCoordinator, layer_ids: list[int] | None = None) -> None:
        if not layers:
            raise ValueError("EPLB needs at least one MoE layer on this pipeline stage")
        shapes = {(m.num_experts, m.num_physical_experts, m.ep_size) for m in layers}
        if len(shapes) != 1:
            raise ValueError(f"EPLB: MoE layers differ in (experts, physical, ep size): {shapes}")
        if any(m.expert_load is None for m in layers):
            raise ValueError("EPLB: MoE layers were built without expert-load counting")
        if layer_ids is not None and len(layer_ids) != len(layers):
            raise ValueError(f"EPLB: {len(layer_ids)} layer_ids for {len(layers)} MoE layers")
        self.layers = layers
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(range(len(layers)))
        self.config = config
        self.ep_group = ep_group
        self.num_logical, self.num_physical, self.ep_size = shapes.pop()
        # [window_size, num_layers, E] int64 per-step loads, a ring indexed by step % window.
        self.window = np.zeros((config.window_size, len(layers), self.num_logical), np.int64)
        self.num_steps = 0
        self.num_rebalances = 0
        self.imbalance_before: np.ndarray | None = None
        self.imbalance_after: np.ndarray | None = None
        self._num_reported = 0

    @classmethod
    def from_model(cls, model: nn.Module, config: EPLBConfig) -> EplbState:
        """Over every `FusedMoE` of `model`, with the EP group of the first layer; each layer's
        id is the first number in its module name (`model.layers.3.mlp.experts` -> 3)."""
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)]
        layers = [m for _, m in named]
        numbers = [re.search(r"\d+", n) for n, _ in named]
        layer_ids = ([int(x.group()) for x in numbers] if all(numbers)
                     and len({x.group() for x in numbers}) == len(numbers) else None)
        group = get_tp_group() if layers and layers[0].use_ep else None
        return cls(layers, config, group if group is not None else _single_group(), layer_ids)

    def reset(self) -> None:
        """Forget all counted loads and rebalances (e.g. those of the profile run)."""
        for layer in self.layers:
            layer.take_expert_load()
        self.window[:] = 0
        self.num_steps = 0
        self.num_rebalances = self._num_reported = 0
        self.imbalance_before = self.imbalance_after = None

    def take_stats(self) -> EplbStats | None:
        """The imbalance of the last rebalance if one happened since the last call, else None
        (so each rebalance is reported once)."""
        if self.num_rebalances == self._num_reported or self.imbalance_before is None:
            return None
        self._num_reported = self.num_rebalances
        return EplbStats(self.num_rebalances, list(self.layer_ids),
                         self.imbalance_before.tolist(), self.imbalance_after.tolist())

    def step(self) -> bool:
        """Record the loads of the step that just ran; rebalance when the interval is due.
        Returns whether it rebalanced."""
        row = self.num_steps % self.config.window_size
        loads = torch.stack([layer.take_expert_load() for layer in self.layers])
        self.window[row] = loads.cpu().numpy()                  # one device -> host copy
        self.num_steps += 1
        if self.num_steps % self.config.step_interval:
            return False
        self.rebalance()
        return True

    def current_placement(self) -> ExpertPlacement:
        p2l = np.stack([m.physical_to_logical_map.cpu().numpy() for m in self.layers])
        return placement_from_physical_to_logical(p2l, self.num_logical,
                                                  self.config.num_redundant_experts)

    def window_loads(self) -> np.ndarray:
        """[num_layers, E] int64 loads of the window summed over the EP group's ranks."""
        loads = torch.from_numpy(self.window.sum(axis=0))
        return self.ep_group.all_reduce(loads).numpy()

    @torch.inference_mode()
    def rebalance(self) -> None:
        """Compute a placement from the window's loads and move every layer's experts to it
        (a collective: every EP rank must call it at the same step)."""
        loads = self.window_loads()
        old = self.current_placement()
        new = rebalance_experts(loads, self.ep_size, self.config.num_redundant_experts)
        received = sum(_move_experts(layer, old, new, i, self.ep_group)
                       for i, layer in enumerate(self.layers))
        self.imbalance_before = imbalance(rank_loads(old, loads, self.ep_size))
        self.imbalance_after = imbalance(rank_loads(new, loads, self.ep_size))
        self.num_rebalances += 1
        logger.info("EPLB rebalance %d: mean imbalance (max/mean over %d ranks) %.3f -> %.3f; "
                    "%.1f MiB of expert weights received by this rank", self.num_rebalances,
                    self.ep_size, float(self.imbalance_before.mean()),
                    float(self.imbalance_after.mean()), received / 2**20)


def _move_experts(layer: FusedMoE, old: ExpertPlacement, new: ExpertPlacement, index: int,
                  group: GroupCoordinator) -> int:
    """Give `layer` layer `index` of `new`: only the slots whose expert changes are rewritten,
    from a copy on the same rank where the old placement has one, else point-to-point from a
    rank that holds one (`plan_expert_moves`; vLLM's rearrangement does the same). Returns the
    bytes this rank received.

    All sends and receives of the layer are posted together (`batch_isend_irecv`) and waited
    for before any slot is overwritten; the slots a rank sends or copies locally are read into
    buffers first, so a slot that is both a source and a destination is read before it is
    written. The transient memory is the moved experts only, not the whole layer.
    """
    moves = plan_expert_moves(old.physical_to_logical[index], new.physical_to_logical[index],
                              group.world_size)
    per_rank = layer.num_local_experts
    me = layer.ep_rank
    params = (layer.w13_weight.data, layer.w2_weight.data)
    local_dst, local_src, ops, received = [], [], [], []
    for dst, src in moves:
        dst_rank, src_rank = dst // per_rank, src // per_rank
        if dst_rank == me and src_rank == me:
            local_dst.append(dst - me * per_rank)
            local_src.append(src - me * per_rank)
        elif src_rank == me:
            for param in params:
                ops.append(dist.P2POp(dist.isend, param[src - me * per_rank].clone(),
                                      group.ranks[dst_rank], group.device_group))
        elif dst_rank == me:
            buffers = [torch.empty_like(param[0]) for param in params]
            for buffer in buffers:
                ops.append(dist.P2POp(dist.irecv, buffer, group.ranks[src_rank],
                                      group.device_group))
            received.append((dst - me * per_rank, buffers))
    local_copies = [param[local_src] for param in params] if local_src else None
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if local_copies is not None:
        for param, copies in zip(params, local_copies):
            param[local_dst] = copies
    for slot, buffers in received:
        for param, buffer in zip(params, buffers):
            param[slot].copy_(buffer)
    layer.set_placement(new, index)
    return sum(b.numel() * b.element_size() for _, buffers in received for b in buffers)


def _single_group() -> GroupCoordinator:
    return GroupCoordinator((0,), 0, None, None)
