"""The fused mixture-of-experts layer: top-k routing, expert grouping, grouped expert GEMMs.

One `FusedMoE` holds every local expert of a sparse MLP block as two stacked weights and runs
them over the flat token batch:

    w13_weight [num_local_experts, 2 * intermediate_per_partition, hidden]   rows: [ w1 | w3 ]
    w2_weight  [num_local_experts, hidden, intermediate_per_partition]

    router_logits [n, E] -> softmax -> top-k (ids [n, k], weights [n, k])
    (token, k) pairs --sort by local expert--> rows grouped per expert
    per expert with rows: silu(x W1^T) * (x W3^T) -> (.) W2^T          (one GEMM pair each)
    weighted, un-sorted to [n, k, H], summed over k -> all-reduce over TP ranks

Tensor parallelism shards every expert's intermediate dimension like the dense MLP (w1/w3 by
rows, w2 by columns), so the partial outputs are summed across ranks at the end, as in
`RowParallelLinear`. With expert parallelism (`ExpertParallelLayout`) each TP rank instead
holds P / tp *whole* physical experts (P = E logical + R redundant replicas); every rank
already has every token's hidden state, so each computes its local experts' share for all
tokens and the same all-reduce sums the shares (see docs/moe.md):

    logical id --(replica = token index % replica count)--> physical id
               --expert_map--> local slot, or -1 (another rank's expert: pair skipped)

On the CPU, `fused_experts` runs all of it (sort, GEMMs, SiLU*mul, weighted combine) in one
native call (`native/kernels/csrc/cpu_fused_moe.cpp`) for steps with few rows per expert;
`fused_experts_torch` is the module path and the reference (`PAGEDLLM_CPU_FUSED_MOE=0`
forces it).

The router's own linear layer (the checkpoint's `gate`) belongs to the model's MoE block.
"""

from __future__ import annotations

import torch
from torch import nn

import numpy as np

from pagedllm.distributed.eplb.policy import ExpertPlacement, default_placement
from pagedllm.distributed.parallel_state import (get_expert_parallel_layout,
                                                 get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.ops import cpu_fused_moe, fused_moe_supported
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.linear import shard_of
from pagedllm.layers.routed_experts import RoutedExpertsCapture
from pagedllm.platforms import current_platform

# Checkpoint shard ids of one expert (vLLM's, the names of Mixtral's tensors): gate, down, up;
# "w13" / "w2" with expert_id=None: a 3-D tensor of all experts (transformers 5's fused
# `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]).
EXPERT_SHARD_IDS = ("w1", "w2", "w3")
ALL_EXPERTS_SHARD_IDS = ("w13", "w2")


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE define it in transformers:
    softmax over all experts (float32), the k largest probabilities, and with `renormalize`
    (HF's `norm_topk_prob`; always on for Mixtral) divided by their sum.

    NOTE(router): Mixtral's original formulation (top-k of the logits, then softmax over
    those k) is the same function: softmax is monotonic, so the top-k sets agree, and
    exp(l_i) / sum_{j in top-k} exp(l_j) = p_i / sum_{j in top-k} p_j.

    Args:
        router_logits: [num_tokens, num_experts], any float dtype.
        top_k: experts per token, 1 <= top_k <= num_experts.
        renormalize: make each token's k weights sum to 1.

    Returns:
        (topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64),
        weights in descending order.

    Raises:
        ValueError: when top_k is outside [1, num_experts].
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be between 1 and the {num_experts} experts")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """All local experts of one sparse MLP block (SiLU-gated, no biases).

    The expert layout (expert parallelism, redundant experts, load counting) comes from
    `parallel_state.get_expert_parallel_layout()` at construction.

    Args:
        num_experts: logical experts of the block (E).
        top_k: experts per token.
        hidden_size: model hidden size (H).
        intermediate_size: every expert's full intermediate size (I), sharded over TP ranks.
        renormalize: renormalize the top-k weights (see `select_experts`).
        reduce_results: all-reduce the output over the TP group (turn off only when the
            caller reduces it together with something else).
        hidden_act: only "silu" is implemented.

    forward(hidden [n, H], router_logits [n, E]) -> [n, H] in hidden's dtype.

    Raises (construction):
        ValueError: for another activation, top_k outside [1, E], an intermediate size the
            TP size does not divide (without EP), or physical experts the EP size does not
            divide.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"FusedMoE: unsupported hidden_act {hidden_act!r}; only 'silu' is "
                             "implemented")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"FusedMoE: top_k {top_k} must be between 1 and the {num_experts} "
                             "experts")
        layout = get_expert_parallel_layout()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.use_ep = layout.enable_expert_parallel
        # Expert parallelism: the EP group is the TP group and experts are not sharded; without
        # it the EP group is this rank alone and every expert's intermediate dim is sharded.
        self.ep_rank, self.ep_size = (self.tp_rank, self.tp_size) if self.use_ep else (0, 1)
        self.moe_tp_rank, self.moe_tp_size = (0, 1) if self.use_ep else (self.tp_rank,
                                                                          self.tp_size)
        if intermediate_size % self.moe_tp_size:
            raise ValueError(f"FusedMoE: expert intermediate size {intermediate_size} not "
                             f"divisible by tp size {self.moe_tp_size}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = intermediate_size // self.moe_tp_size
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.num_redundant_experts = layout.num_redundant_experts
        placement = default_placement(1, num_experts, self.ep_size, self.num_redundant_experts)
        self.num_physical_experts = placement.num_physical_experts
        self.num_local_experts = self.num_physical_experts // self.ep_size
        max_replicas = self.num_redundant_experts + 1
        self.register_buffer("physical_to_logical_map",
                             torch.zeros(self.num_physical_experts, dtype=torch.int64),
                             persistent=False)  # [P] physical id -> logical id
        self.register_buffer("logical_to_physical_map",
                             torch.zeros(num_experts, max_replicas, dtype=torch.int64),
                             persistent=False)  # [E, R + 1] physical copies, -1 padded
        self.register_buffer("logical_replica_count",
                             torch.ones(num_experts, dtype=torch.int64),
                             persistent=False)  # [E]
        self.register_buffer("expert_map",
                             torch.zeros(self.num_physical_experts, dtype=torch.int64),
                             persistent=False)  # [P] physical id -> local slot or -1
        # [E] int64 tokens routed to each logical expert since the last `take_expert_load`.
        self.expert_load = (torch.zeros(num_experts, dtype=torch.int64)
                            if layout.count_expert_load else None)
        self.set_placement(placement, 0)
        inter = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * inter, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, inter),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()
        # None: float experts; else e.g. a `GGUFMoEMethod` (layers/quantization/gguf_moe.py)
        # that stores the experts its own way and runs them (`set_expert_method`).
        self.quant_method = None
        # Routed-experts capture (worker/routed_experts.py binds it): the buffer this layer's
        # router choices go to, and this layer's index among the model's MoE layers.
        self.routed_experts_capture: RoutedExpertsCapture | None = None
        self.moe_layer_index = 0

    def set_expert_method(self, method) -> None:
        """Store (and run) the experts by `method` from now on; the weights are loaded after."""
        method.create_weights(self)
        self.quant_method = method

    def set_placement(self, placement: ExpertPlacement, layer: int) -> None:
        """Adopt layer `layer` of `placement` as this layer's maps (the weights of the local
        slots are the caller's business: see worker/eplb_state.py).

        Raises:
            ValueError: when the placement's expert counts differ from this layer's.
        """
        if (placement.num_physical_experts != self.num_physical_experts
                or placement.num_logical_experts != self.num_experts):
            raise ValueError(f"FusedMoE: placement of {placement.num_logical_experts} logical / "
                             f"{placement.num_physical_experts} physical experts, layer has "
                             f"{self.num_experts} / {self.num_physical_experts}")
        p2l = torch.from_numpy(placement.physical_to_logical[layer])
        self.physical_to_logical_map.copy_(p2l)
        self.logical_to_physical_map.copy_(torch.from_numpy(
            placement.logical_to_physical[layer]))
        self.logical_replica_count.copy_(torch.from_numpy(
            placement.logical_replica_count[layer]))
        first = self.ep_rank * self.num_local_experts
        expert_map = torch.full((self.num_physical_experts,), -1, dtype=torch.int64)
        expert_map[first:first + self.num_local_experts] = torch.arange(self.num_local_experts)
        self.expert_map.copy_(expert_map)
        # Whether a logical id is its own physical id and local slot (one EP rank, no
        # redundant experts, no rebalance): forward then skips the two map gathers.
        self.identity_maps = (
            self.num_redundant_experts == 0 and self.num_local_experts == self.num_experts
            and bool(torch.equal(self.logical_to_physical_map[:, 0],
                                 torch.arange(self.num_experts)))
            and bool(torch.equal(self.expert_map, torch.arange(self.num_physical_experts))))

    def local_logical_ids(self) -> np.ndarray:
        """[num_local_experts] int64, the logical expert each local slot holds."""
        first = self.ep_rank * self.num_local_experts
        return self.physical_to_logical_map[first:first + self.num_local_experts].cpu().numpy()

    def take_expert_load(self) -> torch.Tensor:
        """[E] int64 tokens routed to each logical expert since the last call (a (token,
        expert) pair counts once), then zeroes the counter.

        Raises:
            RuntimeError: when the layer was built without `count_expert_load`.
        """
        if self.expert_load is None:
            raise RuntimeError("FusedMoE: expert loads are counted only with EPLB enabled")
        load = self.expert_load.clone()
        self.expert_load.zero_()
        return load

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str | None = None,
                      expert_id: int | None = None) -> None:
        """Copy one checkpoint tensor into this rank's part of the stacked expert weights.

        Args:
            param: `w13_weight` or `w2_weight`.
            loaded: a tensor or lazy checkpoint tensor (`shape`, `narrow`, `materialize`).
                With `expert_id`: one expert's w1/w3 [I, H] ("w1" gate, "w3" up) or w2 [H, I].
                Without: all experts at once, "w13" [E, 2I, H] (gate rows then up rows) or
                "w2" [E, H, I].
            shard_id: "w1", "w2", "w3" (with expert_id) or "w13", "w2" (without).
            expert_id: logical expert id; it is copied into every local slot holding it (none:
                skipped).

        Raises:
            ValueError: for an unknown shard id, a shard id that does not fit `param`, an
                expert id out of range, or a shape mismatch (naming both shapes).
        """
        if self.quant_method is not None:
            self.quant_method.load_weight(self, param, loaded, shard_id, expert_id)
            return
        is_w13 = param is self.w13_weight
        if expert_id is None:
            self._load_all_experts(param, loaded, shard_id, is_w13)
            return
        if shard_id not in EXPERT_SHARD_IDS:
            raise ValueError(f"FusedMoE: expert shard id must be one of {EXPERT_SHARD_IDS}, got "
                             f"{shard_id!r}")
        if is_w13 != (shard_id != "w2"):
            raise ValueError(f"FusedMoE: shard id {shard_id!r} does not belong to "
                             f"{'w13_weight' if is_w13 else 'w2_weight'}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"FusedMoE: expert id {expert_id} outside [0, {self.num_experts})")
        for slot in np.flatnonzero(self.local_logical_ids() == expert_id).tolist():
            self._load_expert(param.data[slot], loaded, shard_id)

    def _load_expert(self, target: torch.Tensor, loaded, shard_id: str) -> None:
        """One expert's w1/w3 [I, H] or w2 [H, I] into its slot `target` (this rank's shard)."""
        inter = self.intermediate_size_per_partition
        part = shard_of(loaded, 1 if shard_id == "w2" else 0, inter * self.moe_tp_size,
                        self.moe_tp_rank, inter)
        if shard_id == "w2":
            _copy(target, part)
            return
        _copy(target.narrow(0, 0 if shard_id == "w1" else inter, inter), part)

    def _load_all_experts(self, param: nn.Parameter, loaded, shard_id: str | None,
                          is_w13: bool) -> None:
        if shard_id not in ALL_EXPERTS_SHARD_IDS or is_w13 != (shard_id == "w13"):
            raise ValueError(f"FusedMoE: a tensor of all experts needs shard id 'w13' for "
                             f"w13_weight or 'w2' for w2_weight, got {shard_id!r}")
        if len(loaded.shape) != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(f"FusedMoE: expected [{self.num_experts}, ...] expert weights, got "
                             f"shape {tuple(loaded.shape)}")
        full_inter = self.intermediate_size_per_partition * self.moe_tp_size
        for slot, expert_id in enumerate(self.local_logical_ids().tolist()):
            one = _narrow(loaded, 0, expert_id, 1)
            target = param.data.narrow(0, slot, 1)
            if shard_id == "w2":
                self._load_expert(target[0], _Squeezed(one), "w2")
                continue
            if loaded.shape[1] != 2 * full_inter:
                raise ValueError(f"FusedMoE: fused gate_up rows {loaded.shape[1]} != 2 x "
                                 f"intermediate size {full_inter}")
            self._load_expert(target[0], _Squeezed(_narrow(one, 1, 0, full_inter)), "w1")
            self._load_expert(target[0], _Squeezed(_narrow(one, 1, full_inter, full_inter)), "w3")

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(hidden, topk_weights, topk_ids)

    def forward_routed(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, experts_fn=None) -> torch.Tensor:
        """The experts over tokens already routed by the caller (a model's own router, e.g.
        DeepSeek's group-limited one: layers/moe_routing.py).

        Args:
            hidden: [n, H].
            topk_weights: [n, top_k] float32, each pair's weight as applied.
            topk_ids: [n, top_k] int64 logical expert ids.
            experts_fn: (hidden, topk_weights, physical ids [n, top_k]) -> [n, H], this
                rank's partial output, run instead of the layer's own expert computation
                (the LoRA wrapper's experts with adapters: lora/moe.py); None: the layer's.

        Returns:
            [n, H] in hidden's dtype (all-reduced over TP ranks unless reduce_results is off).
        """
        if self.routed_experts_capture is not None:
            self.routed_experts_capture.record(self.moe_layer_index, topk_ids)
        if self.expert_load is not None:
            self.expert_load += torch.bincount(topk_ids.flatten(), minlength=self.num_experts)
        physical_ids = topk_ids if self.identity_maps else self._physical_ids(topk_ids)
        if experts_fn is not None:
            out = experts_fn(hidden, topk_weights, physical_ids)
        elif self.quant_method is not None:
            out = self.quant_method.apply(self, hidden, topk_weights, physical_ids)
        else:
            out = fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights,
                                physical_ids, self.expert_map, self.act_fn,
                                identity_map=self.identity_maps)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def _physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[n, k] logical ids -> physical ids; a logical expert with c copies sends token t's
        pair to copy t % c, so its load spreads evenly over the copies."""
        if self.num_redundant_experts == 0:
            return self.logical_to_physical_map[topk_ids, 0]
        token_index = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        replica = token_index % self.logical_replica_count[topk_ids]
        return self.logical_to_physical_map[topk_ids, replica]


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor,
                  act_fn: nn.Module, identity_map: bool = False) -> torch.Tensor:
    """Run each token through its routed local experts and sum them, weighted: the native CPU
    kernel (`ops.cpu_fused_moe`) where `native_moe_applies`, else `fused_experts_torch`.
    Arguments and result as `fused_experts_torch`'s; `identity_map`: the caller knows
    `expert_map` to be the identity (the ids are the local slots, not gathered again)."""
    if native_moe_applies(hidden, w13, w2, topk_ids, expert_map, act_fn):
        return cpu_fused_moe(hidden, w13, w2, topk_weights,
                             topk_ids if identity_map else expert_map[topk_ids], checked=True)
    return fused_experts_torch(hidden, w13, w2, topk_weights, topk_ids, expert_map, act_fn)


def native_moe_enabled() -> bool:
    """False when `PAGEDLLM_CPU_FUSED_MOE` is 0/false/off/no (the torch path runs), or when
    the CPU kernels are off or did not build (`PAGEDLLM_CPU_KERNELS`); the switch as read at
    engine start (`current_platform.options`), not from the environment on every forward."""
    return current_platform.options.cpu_fused_moe and cpu_kernels() is not None


def native_moe_applies(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_ids: torch.Tensor, expert_map: torch.Tensor,
                       act_fn: nn.Module) -> bool:
    """Whether `fused_experts` takes the native kernel for this step: SiLU-and-mul experts,
    operands `fused_moe_supported` takes, the kernels on, and at most the platform's native
    linear limit for packed weights rows per expert on average.

    NOTE(crossover): the kernel runs an expert's short row blocks (decode) by linear_kernel.h's
    dot-product micro-kernels and its blocks of 32 rows or more (prefill) by outer-product
    panel tiles in float32, bfloat16 weights widened per tile (fused_moe_kernel.h, "Panel
    form"). Like the packed GEMM, that form matches or beats oneDNN/MKL GEMMs per expert at
    prefill sizes (float32) and outruns torch's bf16 GEMMs on CPUs without AMX several times
    (docs/benchmarks.md, "MoE prefill in the panel form"), so the limit is the platform's for
    packed weights (`fused_decoder_max_tokens(..., packed_weights=True)`: every size).
    """
    if not isinstance(act_fn, SiluAndMul) or not fused_moe_supported(hidden, w13, w2):
        return False
    if not native_moe_enabled():
        return False
    max_rows = current_platform.fused_decoder_max_tokens(hidden.dtype, packed_weights=True)
    return topk_ids.numel() <= expert_map.shape[0] * max_rows


def fused_experts_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        expert_map: torch.Tensor, act_fn: nn.Module,
                        expert_forward=None) -> torch.Tensor:
    """Run each token through its routed local experts and sum them, weighted (torch ops).

    The n*k (token, slot) pairs are sorted by local expert (a stable sort, so an expert's rows
    keep token order); each expert with rows runs two GEMMs over its contiguous block; the
    weighted rows are scattered back to their (token, slot) places and summed over the k slots
    of each token (a scatter-add, see NOTE(combine)). Pairs routed to a non-local expert (map
    entry -1) sort last and are dropped.

        pairs (t, j) -> flat p = t*k + j      order = argsort(local_id[p])
        sorted rows:  [ expert 0 rows | expert 1 rows | ... | non-local ]
                        ^ counts[0]     ^ counts[1]

    Args:
        hidden: [n, H], model dtype.
        w13: [L, 2*I_p, H] (gate rows, then up rows); w2: [L, H, I_p]; L local experts.
        topk_weights: [n, k] float32; topk_ids: [n, k] int64 physical expert ids (the
            logical ids when there are no redundant experts and no rebalance).
        expert_map: [P] int64, physical id -> local slot or -1.
        act_fn: gated activation [m, 2*I_p] -> [m, I_p].
        expert_forward: (local expert, rows [m, H]) -> [m, H], replacing the two float GEMMs
            (experts stored otherwise, e.g. in GGUF blocks: layers/quantization/gguf_moe.py).

    Returns:
        [n, H] in hidden's dtype (this rank's partial sum under TP).
    """
    order, counts = sort_routed_pairs(topk_ids, expert_map, w13.shape[0])
    x = hidden[order // topk_ids.shape[1]]                              # [m, H]
    rows_out = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        if expert_forward is not None:
            rows_out[rows] = expert_forward(expert, x[rows])
        else:
            gate_up = current_platform.linear(x[rows], w13[expert])
            rows_out[rows] = current_platform.linear(act_fn(gate_up), w2[expert])
        start += count
    return combine_routed_pairs(rows_out, topk_weights, order, hidden.dtype)


def sort_routed_pairs(topk_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int
                      ) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs routed to local experts, grouped by local expert.

    Args:
        topk_ids: [n, k] int64 physical expert ids; expert_map: [P] int64 physical id ->
            local slot or -1; num_local: local experts (L).

    Returns:
        (order [m] int64: flat pair ids t*k + j sorted by local expert (stable, so each
        expert's rows keep token order; pairs of non-local experts dropped), counts: L rows
        per local expert).
    """
    local_ids = expert_map[topk_ids].flatten()                          # [n*k]
    local_ids = torch.where(local_ids < 0, num_local, local_ids)
    order = torch.argsort(local_ids, stable=True)                       # [n*k]
    counts = torch.bincount(local_ids, minlength=num_local + 1).tolist()
    return order[:topk_ids.numel() - counts[num_local]], counts[:num_local]


def combine_routed_pairs(rows_out: torch.Tensor, topk_weights: torch.Tensor,
                         order: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum each token's expert outputs, weighted: rows_out [m, H] (the pairs `order` lists,
    `sort_routed_pairs`) times topk_weights [n, k] float32 -> [n, H] in `dtype`."""
    num_tokens, top_k = topk_weights.shape
    weights = topk_weights.flatten()[order].unsqueeze(1)                # [m, 1] float32
    # NOTE(combine): the scatter-add back to the tokens is written as an un-sort into the
    # [n*k, H] pair layout plus a sum over k, not `index_add_`: both give the same sums, but
    # CPU `index_add_` (scatter_add_) opens a parallel region even for a decode step's few
    # rows, costly on a loaded machine (index_put_ and the sum stay single-threaded below
    # torch's grain size; docs/benchmarks.md, "Measurements behind choices in the code").
    pairs = rows_out.new_zeros(num_tokens * top_k, rows_out.shape[1], dtype=dtype)
    pairs[order] = (rows_out.float() * weights).to(dtype)
    return pairs.view(num_tokens, top_k, rows_out.shape[1]).sum(dim=1)


def _narrow(loaded, dim: int, start: int, length: int):
    if start + length > loaded.shape[dim]:
        raise ValueError(f"FusedMoE: checkpoint tensor of shape {tuple(loaded.shape)} too small "
                         f"for [{start}, {start + length}) on dim {dim}")
    return loaded.narrow(dim, start, length)


def _copy(target: torch.Tensor, loaded) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: expert weight {tuple(target.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    target.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded.materialize())


class _Squeezed:
    """A [1, ...] tensor or lazy checkpoint tensor seen without its leading dimension (narrow
    stays lazy; the leading dimension is dropped when the slice is read)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.shape = torch.Size(inner.shape[1:])

    def narrow(self, dim: int, start: int, length: int) -> _Squeezed:
        return _Squeezed(self._inner.narrow(dim + 1, start, length))

    def materialize(self) -> torch.Tensor:
        inner = self._inner
        tensor = inner if isinstance(inner, torch.Tensor) else inner.materialize()
        return tensor[0]
