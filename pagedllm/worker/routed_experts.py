"""Routed-experts capture on the worker side (`enable_return_routed_experts`; vLLM's design).

    forward:  each FusedMoE layer writes its top-k ids into the device buffer
              (layers/routed_experts.py)                      [num_tokens, L, k] int16
    collect:  one host copy of the step's rows, stored at the tokens' KV slots
              (slot_routing [num_slots, L, k] int16, -1 = nothing recorded), and, for each
              request that asked, the rows of its positions this step -> ModelRunnerOutput

Prefix caching: a request's cached prompt tokens were computed by an earlier forward, whose
routing sits at their KV slots (vLLM keeps it per KV slot too). On the request's first step its
cached prefix's rows are read from there and sent from position 0, so cached tokens carry the
routing recorded when their blocks were computed: the same tokens after the same prefix, hence
the same routing. A block's slots are rewritten only when the block is reused, which first
drops its hash, so a prefix hit never reads another block's routing. Preemption: the request
is sent whole again and its positions are resent; the scheduler overwrites by position
(core/routed_experts.py).

Only requests whose `SamplingParams.return_routed_experts` is set (the default) get rows;
every token's routing is stored at its slots either way, so a later request hitting that
prefix finds it. Cost when on: one [num_tokens, L, k] int16 device->host copy per step and
L * k * 2 bytes of host memory per KV slot; nothing when off.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.kv_cache_groups import KVCacheGroupSpec
from pagedllm.core.routed_experts import NO_EXPERT, ROUTED_EXPERTS_DTYPE
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.routed_experts import RoutedExpertsCapture
from pagedllm.worker.input_batch import InputBatch, RequestStates


class RoutedExpertsRecorder:
    """Binds a capture buffer to a model's MoE layers and turns each step's captured rows into
    per-request routing (see the module docstring).

    Args:
        model: the target model (its `FusedMoE` modules, in module order = layer order).
        max_num_tokens: most tokens of one forward (the buffer's rows).
        device: the model's device.
        kv_cache_windows: the runner's KV cache groups' windows; routing is kept by the slots
            of the first full-attention group.

    Raises:
        ValueError: a model without MoE layers (a dense model has no routing to return), MoE
            layers with different top_k, 32,768 or more experts, or no full-attention KV cache
            group.
    """

    def __init__(self, model: torch.nn.Module, max_num_tokens: int, device: torch.device,
                 kv_cache_windows: tuple) -> None:
        layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        if not layers:
            raise ValueError(f"enable_return_routed_experts: {type(model).__name__} has no "
                             f"mixture-of-experts layers, so no routed experts to return")
        top_ks = {layer.top_k for layer in layers}
        if len(top_ks) != 1:
            raise ValueError(f"enable_return_routed_experts: the MoE layers route to different "
                             f"numbers of experts {sorted(top_ks)}")
        if max(layer.num_experts for layer in layers) > np.iinfo(ROUTED_EXPERTS_DTYPE).max:
            raise ValueError("enable_return_routed_experts: more than 32,767 experts per layer")
        groups = [g for g, w in enumerate(kv_cache_windows) if w is None]
        if not groups:
            raise ValueError(f"enable_return_routed_experts: {type(model).__name__} has no "
                             f"full-attention layers (the routing is kept by their KV slots)")
        self.kv_cache_group = groups[0]
        self.num_moe_layers, self.top_k = len(layers), top_ks.pop()
        self.capture = RoutedExpertsCapture(max_num_tokens, self.num_moe_layers, self.top_k,
                                            device)
        for index, layer in enumerate(layers):
            layer.routed_experts_capture, layer.moe_layer_index = self.capture, index
        # [num_slots, num_moe_layers, top_k] int16 (None until the KV cache exists).
        self.slot_routing: np.ndarray | None = None
        # Requests that asked, and of those the ones whose cached prefix is still to be sent.
        self._wanted: set[str] = set()
        self._prefix_pending: set[str] = set()

    def allocate(self, groups: tuple[KVCacheGroupSpec, ...], block_size: int) -> None:
        """A fresh per-slot store for a newly allocated KV cache (nothing recorded)."""
        num_slots = groups[self.kv_cache_group].num_blocks * block_size
        self.slot_routing = np.full((num_slots, self.num_moe_layers, self.top_k), NO_EXPERT,
                                    dtype=ROUTED_EXPERTS_DTYPE)

    def update(self, so: SchedulerOutput) -> None:
        """Follow the step's request changes (call before the forward)."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._wanted.discard(req_id)
            self._prefix_pending.discard(req_id)
        for req in so.scheduled_new_reqs:
            if req.sampling_params.return_routed_experts:
                self._wanted.add(req.req_id)
                if req.num_computed_tokens:
                    self._prefix_pending.add(req.req_id)

    def collect(self, batch: InputBatch, slot_mapping: torch.Tensor, states: RequestStates
                ) -> dict[str, tuple[int, np.ndarray]]:
        """After the forward of `batch`: store its rows at their slots and return, per request
        that asked, (first position, rows [m, num_moe_layers, top_k] int16).

        Args:
            batch: the step's inputs.
            slot_mapping: [num_kv_cache_groups, >= num_tokens] int64, the step's slots.
            states: the runner's request states (block tables of cached prefixes).
        """
        n = int(batch.query_start_loc_np[-1])
        routing = self.capture.buffer[:n].cpu().numpy()
        if self.slot_routing is not None:
            slots = slot_mapping[self.kv_cache_group, :n].cpu().numpy()
            keep = slots >= 0
            self.slot_routing[slots[keep]] = routing[keep]
        out: dict[str, tuple[int, np.ndarray]] = {}
        table = states.block_tables[self.kv_cache_group]
        for b, req_id in enumerate(batch.req_ids):
            if req_id not in self._wanted:
                continue
            q0, q1 = int(batch.query_start_loc_np[b]), int(batch.query_start_loc_np[b + 1])
            start = int(batch.seq_lens_np[b]) - (q1 - q0)
            rows = routing[q0:q1]
            if req_id in self._prefix_pending:
                self._prefix_pending.discard(req_id)
                rows = np.concatenate([self._cached_rows(table, batch.idx_mapping[b], start),
                                       rows])
                start = 0
            out[req_id] = (start, rows.copy())
        return out

    def _cached_rows(self, table, row: int, num_cached: int) -> np.ndarray:
        """[num_cached, L, k] routing stored at the slots of positions [0, num_cached) of
        request slot `row` (-1 before the KV cache exists)."""
        if self.slot_routing is None:
            return np.full((num_cached, self.num_moe_layers, self.top_k), NO_EXPERT,
                           dtype=ROUTED_EXPERTS_DTYPE)
        positions = np.arange(num_cached, dtype=np.int64)
        slots = table.compute_slot_mapping(np.full(num_cached, row, dtype=np.int64), positions)
        return self.slot_routing[slots]
