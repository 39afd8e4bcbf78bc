"""LoRA on mixture-of-experts experts: `LoRAFusedMoE` wraps a model's `FusedMoE` (the base
layer inside, unchanged) and, in a step with adapter tokens, runs every routed (token, expert)
pair through its expert plus the delta of the token's adapter for that expert:

    gate_up = x W13_e^T + (x A13_{s,e}^T) B13_{s,e}^T        (s: the token's adapter slot)
    h       = silu(gate_up[:, :I]) * gate_up[:, I:]
    out     = h W2_e^T  + (h A2_{s,e}^T)  B2_{s,e}^T          summed over the k experts, weighted

The gate/up delta enters before the activation, so it cannot be added to the layer's output
afterwards: the pairs are grouped by expert (as the base layer does, `fused_experts_torch`)
and, inside each expert's rows, by slot; each (expert, slot) group gets one shrink and one
expand product. This is the grouping of vLLM's fused-MoE LoRA (its Triton kernel tiles the
same (token, expert, adapter) triples); here it is torch operations per group. Base tokens (no
adapter) are in no group. Steps without adapter tokens run the base layer (the native CPU
fused-MoE kernel included) unchanged.

Slots, per layer (B stored transposed, like lora/layers.py; the scaling folded into B):

    lora_a13: [max_loras, E, 2 R, H]     rows [0, R): gate_up or gate,  [R, 2R): up
    lora_b13: [max_loras, E, 2 R, 2 I_p] gate_up's B^T spans all 2 I_p columns; gate's the
                                         first I_p, up's the last I_p
    lora_a2:  [max_loras, E, R, I_p]     lora_b2: [max_loras, E, R, H]
    (E experts, R = max_lora_rank, I_p the intermediate size this rank holds)

transformers 5's fused gate_up_proj has one A for gate and up together (one slice of width R);
per-expert adapters have their own gate and up A (two slices). Under tensor parallelism the
experts' intermediate dimension is sharded like their weights: B13 keeps this rank's rows of
gate and of up, A2 this rank's input columns (the delta of down is then a partial sum that the
layer's all-reduce adds up with the base output, as for a row-parallel linear).

Not supported (refused when the layers are wrapped, naming the reason): expert parallelism
(the experts a rank holds would need the adapters' experts moved with them under EPLB) and
quantized experts (GGUF: their method runs the experts its own way).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pagedllm.layers.fused_moe import (FusedMoE, fused_experts_torch, select_experts,
                                       sort_routed_pairs)
from pagedllm.platforms import current_platform

# Expert projections an adapter may hold (LoRAAdapter.weights' "experts.*" modules), in the
# order of `LoRAFusedMoE.set_lora`'s slice index.
EXPERT_SLICES = ("experts.gate_up", "experts.gate", "experts.up", "experts.down")


class LoRAFusedMoE(nn.Module):
    """A `FusedMoE` plus the step's adapters on its experts (module docstring).

    Args:
        base_layer: the model's fused-MoE layer (float experts, no expert parallelism).
        max_loras, max_lora_rank: slot count and width.
        state: the step state shared by all wrappers (`lora.layers.LoRAStepState`).
        device, dtype: of the slots.

    forward(hidden [n, H], router_logits [n, E]) -> [n, H], as `FusedMoE.forward`.

    Raises (construction):
        ValueError: for a layer under expert parallelism or with quantized experts.
    """

    def __init__(self, base_layer: FusedMoE, max_loras: int, max_lora_rank: int, state,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        if base_layer.use_ep or base_layer.num_redundant_experts:
            raise ValueError("LoRA on MoE experts is not supported with expert parallelism "
                             "(enable_expert_parallel): start the engine without it")
        if base_layer.quant_method is not None:
            raise ValueError(f"LoRA on MoE experts is not supported for quantized experts "
                             f"({type(base_layer.quant_method).__name__}): use a float "
                             f"checkpoint")
        self.base_layer = base_layer
        self.state = state
        self.max_loras = max_loras
        self.max_lora_rank = rank = max_lora_rank
        experts, hidden = base_layer.num_local_experts, base_layer.hidden_size
        inter = base_layer.intermediate_size_per_partition
        self.inter_offset = base_layer.moe_tp_rank * inter   # this rank's intermediate rows

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(max_loras, experts, *shape, device=device, dtype=dtype)

        self.register_buffer("lora_a13", zeros(2 * rank, hidden), persistent=False)
        self.register_buffer("lora_b13", zeros(2 * rank, 2 * inter), persistent=False)
        self.register_buffer("lora_a2", zeros(rank, inter), persistent=False)
        self.register_buffer("lora_b2", zeros(rank, hidden), persistent=False)

    def reset_lora(self, slot: int) -> None:
        """Zero slot `slot` (an adapter that leaves these experts out then adds nothing)."""
        for buffer in (self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2):
            buffer[slot].zero_()

    def set_lora(self, slot: int, slice_index: int, lora_a: torch.Tensor,
                 lora_b: torch.Tensor) -> None:
        """Write one expert projection of an adapter into slot `slot`, keeping this rank's
        shard.

        Args:
            slice_index: its index in EXPERT_SLICES.
            lora_a: [E, r, in_features]; lora_b: [E, out_features, r], scaled (whole, as
                `LoRAAdapter.weights` holds them; r <= max_lora_rank).
        """
        name = EXPERT_SLICES[slice_index]
        rank, inter, offset = lora_a.shape[1], self.lora_a2.shape[-1], self.inter_offset
        b_t = lora_b.transpose(1, 2)                                       # [E, r, out]
        if name == "experts.down":
            self.lora_a2[slot, :, :rank].copy_(lora_a.narrow(2, offset, inter))
            self.lora_b2[slot, :, :rank].copy_(b_t)
            return
        row = self.max_lora_rank if name == "experts.up" else 0
        self.lora_a13[slot, :, row:row + rank].copy_(lora_a)
        target = self.lora_b13[slot, :, row:row + rank]                    # [E, r, 2 I_p]
        if name == "experts.gate_up":   # B's rows: gate's I, then up's I
            half = lora_b.shape[1] // 2
            target[..., :inter].copy_(b_t.narrow(2, offset, inter))
            target[..., inter:].copy_(b_t.narrow(2, half + offset, inter))
        else:
            column = inter if name == "experts.up" else 0
            target[..., column:column + inter].copy_(b_t.narrow(2, offset, inter))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.state.mapping is None:
            return base(hidden, router_logits)
        topk_weights, topk_ids = select_experts(router_logits, base.top_k, base.renormalize)
        return self.forward_routed(hidden, topk_weights, topk_ids)

    def forward_routed(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        """`FusedMoE.forward_routed` (tokens routed by the model's own router, e.g.
        DeepSeek's) with the adapters' deltas."""
        mapping = self.state.mapping
        if mapping is None:
            return self.base_layer.forward_routed(hidden, topk_weights, topk_ids)
        return self.base_layer.forward_routed(
            hidden, topk_weights, topk_ids, experts_fn=partial(self._experts,
                                                               mapping.batch_slots))

    def _experts(self, token_slots: torch.Tensor, hidden: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts with the adapters' deltas: token_slots [n] int64 (-1: base),
        the rest as `fused_experts_torch`'s arguments."""
        base = self.base_layer
        order, counts = sort_routed_pairs(topk_ids, base.expert_map, base.num_local_experts)
        groups = expert_slot_groups(token_slots[order // topk_ids.shape[1]], counts,
                                    self.max_loras)
        return fused_experts_torch(hidden, base.w13_weight, base.w2_weight, topk_weights,
                                   topk_ids, base.expert_map, base.act_fn,
                                   expert_forward=partial(self._expert_forward, groups))

    def _expert_forward(self, groups: dict[int, list[tuple[int, torch.Tensor]]], expert: int,
                        x: torch.Tensor) -> torch.Tensor:
        """Local expert `expert` over its rows x [m, H], each (slot, rows) group of `groups`
        with its adapter's deltas -> [m, H]."""
        base = self.base_layer
        gate_up = current_platform.linear(x, base.w13_weight[expert])
        mine = groups.get(expert, ())
        for slot, rows in mine:
            gate_up.index_add_(0, rows, (x[rows] @ self.lora_a13[slot, expert].t())
                               @ self.lora_b13[slot, expert])
        h = base.act_fn(gate_up)
        out = current_platform.linear(h, base.w2_weight[expert])
        for slot, rows in mine:
            out.index_add_(0, rows, (h[rows] @ self.lora_a2[slot, expert].t())
                           @ self.lora_b2[slot, expert])
        return out


def expert_slot_groups(pair_slots: torch.Tensor, counts: list[int], num_slots: int
                       ) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """The adapter pairs of one step's expert-sorted rows, grouped by (expert, slot).

    Args:
        pair_slots: [m] int64, the slot of each row's token (-1: base), rows sorted by local
            expert (`sort_routed_pairs`); counts: rows per local expert.
        num_slots: max_loras.

    Returns:
        local expert -> [(slot, row indices [g] int64 within that expert's block of rows)],
        experts without adapter rows absent.
    """
    device = pair_slots.device
    counts_t = torch.tensor(counts, device=device)
    experts = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t)
    block_start = torch.cumsum(counts_t, 0) - counts_t                 # [L] first row
    adapter_rows = torch.nonzero(pair_slots >= 0).squeeze(1)
    if not adapter_rows.numel():
        return {}
    keys = experts[adapter_rows] * num_slots + pair_slots[adapter_rows]
    keys, order = torch.sort(keys, stable=True)
    rows = adapter_rows[order]
    unique, sizes = torch.unique_consecutive(keys, return_counts=True)
    rows = rows - block_start[keys // num_slots]
    groups: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for key, piece in zip(unique.tolist(), torch.split(rows, sizes.tolist())):
        expert, slot = divmod(key, num_slots)
        groups.setdefault(expert, []).append((slot, piece))
    return groups
