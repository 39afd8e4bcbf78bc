"""EPLB placement policy: which logical experts get redundant replicas, and which rank holds
each physical expert. Pure numpy, no torch, no process groups: every rank runs it on the same
loads and gets the same plan.

The scheme is DeepSeek's EPLB, "replicate the hottest, pack by load" (its global policy,
https://github.com/deepseek-ai/EPLB, `rebalance_experts` / `replicate_experts` /
`balanced_packing`; described in the DeepSeek-V3 technical report, §3.4); the code here is
written from that description:

    loads [layers, E]  --replicate-->  R extra replicas, each to the expert with the highest
                                        load per replica (its load is split evenly)
                       --pack-------->  the E + R physical experts, heaviest first, each to the
                                        least-loaded rank that still has a free slot

    physical expert p lives on rank p // (P / num_ranks), slot p % (P / num_ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExpertPlacement:
    """A logical -> physical expert map for every MoE layer.

    Attributes:
        physical_to_logical: [num_layers, num_physical] int64, the logical expert held by each
            physical slot; rank r holds physical experts [r * S, (r + 1) * S), S = slots per rank.
        logical_to_physical: [num_layers, num_logical, max_replicas] int64, each logical
            expert's physical copies in increasing order, padded with -1; max_replicas =
            num_redundant_experts + 1 (the most one expert can get).
        logical_replica_count: [num_layers, num_logical] int64, >= 1.
    """

    physical_to_logical: np.ndarray
    logical_to_physical: np.ndarray
    logical_replica_count: np.ndarray

    @property
    def num_physical_experts(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical_experts(self) -> int:
        return self.logical_replica_count.shape[1]


def placement_from_physical_to_logical(physical_to_logical: np.ndarray, num_logical: int,
                                       num_redundant_experts: int) -> ExpertPlacement:
    """Derive the inverse map and replica counts from `physical_to_logical` [layers, P].

    Raises:
        ValueError: when some logical expert has no physical copy, an id is out of range, or an
            expert has more than num_redundant_experts + 1 copies.
    """
    p2l = np.asarray(physical_to_logical, dtype=np.int64)
    if p2l.ndim != 2:
        raise ValueError(f"physical_to_logical must be [layers, physical], got {p2l.shape}")
    if p2l.size and (p2l.min() < 0 or p2l.max() >= num_logical):
        raise ValueError(f"physical_to_logical holds ids outside [0, {num_logical})")
    num_layers, num_physical = p2l.shape
    max_replicas = num_redundant_experts + 1
    counts = np.zeros((num_layers, num_logical), dtype=np.int64)
    l2p = np.full((num_layers, num_logical, max_replicas), -1, dtype=np.int64)
    for layer in range(num_layers):
        for phys in range(num_physical):
            logical = p2l[layer, phys]
            if counts[layer, logical] >= max_replicas:
                raise ValueError(f"layer {layer}: logical expert {logical} has more than "
                                 f"{max_replicas} physical copies")
            l2p[layer, logical, counts[layer, logical]] = phys
            counts[layer, logical] += 1
    if (counts == 0).any():
        layer, logical = np.argwhere(counts == 0)[0]
        raise ValueError(f"layer {layer}: logical expert {logical} has no physical copy")
    return ExpertPlacement(p2l, l2p, counts)


def default_placement(num_layers: int, num_logical: int, num_ranks: int,
                      num_redundant_experts: int) -> ExpertPlacement:
    """The placement before any load is known: physical expert p holds logical p for p < E and
    the redundant slots E..E+R-1 hold logical 0..R-1 (vLLM's initial map).

    Raises:
        ValueError: see `check_expert_layout`.
    """
    check_expert_layout(num_logical, num_ranks, num_redundant_experts)
    num_physical = num_logical + num_redundant_experts
    p2l = np.tile(np.arange(num_physical, dtype=np.int64) % num_logical, (num_layers, 1))
    return placement_from_physical_to_logical(p2l, num_logical, num_redundant_experts)


def check_expert_layout(num_logical: int, num_ranks: int, num_redundant_experts: int) -> None:
    """Raises ValueError unless E >= 1, num_ranks >= 1, R >= 0 and num_ranks divides E + R."""
    if num_logical < 1 or num_ranks < 1:
        raise ValueError(f"need >= 1 expert and >= 1 rank, got {num_logical} experts and "
                         f"{num_ranks} ranks")
    if num_redundant_experts < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
    num_physical = num_logical + num_redundant_experts
    if num_physical % num_ranks:
        raise ValueError(f"{num_logical} experts + {num_redundant_experts} redundant = "
                         f"{num_physical} physical experts are not divisible by the "
                         f"{num_ranks} expert-parallel ranks")


def replicate_experts(load: np.ndarray, num_redundant_experts: int) -> np.ndarray:
    """Replica counts of one layer: each of the R extra replicas goes to the expert whose load
    per replica is highest (ties: the lowest expert id).

    Args:
        load: [E] non-negative loads (tokens routed to each logical expert).

    Returns:
        [E] int64 replica counts, each >= 1, summing to E + R.
    """
    counts = np.ones(load.shape[0], dtype=np.int64)
    for _ in range(num_redundant_experts):
        counts[int(np.argmax(load / counts))] += 1
    return counts


def pack_experts(load: np.ndarray, counts: np.ndarray, num_ranks: int) -> np.ndarray:
    """Assign one layer's physical experts to ranks, heaviest first, each to the least-loaded
    rank with a free slot (preferring ranks without a copy of the same expert, so replicas
    spread); ties go to the lowest rank.

    Args:
        load: [E] loads; counts: [E] replica counts (each replica carries load / count).
        num_ranks: ranks; sum(counts) must be divisible by it.

    Returns:
        [P] int64 physical_to_logical, rank r's slots at [r * S, (r + 1) * S), sorted by
        logical id within a rank.
    """
    slots = int(counts.sum()) // num_ranks
    replica_logical = np.repeat(np.arange(load.shape[0]), counts)
    replica_load = (load / counts)[replica_logical]
    order = np.argsort(-replica_load, kind="stable")
    rank_load = np.zeros(num_ranks)
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for item in order:
        logical = int(replica_logical[item])
        free = [r for r in range(num_ranks) if len(held[r]) < slots]
        spread = [r for r in free if logical not in held[r]] or free
        rank = min(spread, key=lambda r: (rank_load[r], r))
        held[rank].append(logical)
        rank_load[rank] += replica_load[item]
    return np.concatenate([np.sort(np.array(h, dtype=np.int64)) for h in held])


def rebalance_experts(weight: np.ndarray, num_ranks: int,
                      num_redundant_experts: int) -> ExpertPlacement:
    """A balanced placement of every layer's experts (see the module docstring).

    Args:
        weight: [num_layers, num_logical] non-negative loads per logical expert (token counts
            over a window; any scale).
        num_ranks: expert-parallel ranks.
        num_redundant_experts: extra physical experts per layer (R).

    Returns:
        An `ExpertPlacement` with num_logical + R physical experts per layer.

    Raises:
        ValueError: for a weight that is not 2-D, negative or not finite, or a layout
            `check_expert_layout` refuses.
    """
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2:
        raise ValueError(f"expert loads must be [num_layers, num_logical], got {weight.shape}")
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("expert loads must be finite and non-negative")
    num_layers, num_logical = weight.shape
    check_expert_layout(num_logical, num_ranks, num_redundant_experts)
    p2l = np.stack([pack_experts(w, replicate_experts(w, num_redundant_experts), num_ranks)
                    for w in weight]) if num_layers else np.zeros((0, num_logical
                                                                  + num_redundant_experts),
                                                                 dtype=np.int64)
    return placement_from_physical_to_logical(p2l, num_logical, num_redundant_experts)


def rank_loads(placement: ExpertPlacement, weight: np.ndarray, num_ranks: int) -> np.ndarray:
    """[num_layers, num_ranks] load each rank serves when every logical expert's load is split
    evenly over its replicas (the split `FusedMoE` makes by token index)."""
    weight = np.asarray(weight, dtype=np.float64)
    layers = np.arange(weight.shape[0])[:, None]
    p2l = placement.physical_to_logical
    per_physical = (weight[layers, p2l]
                    / placement.logical_replica_count[layers, p2l])       # [layers, P]
    return per_physical.reshape(weight.shape[0], num_ranks, -1).sum(axis=2)


def imbalance(loads_per_rank: np.ndarray) -> np.ndarray:
    """Load imbalance max / mean over the last axis (1.0 is perfect balance; an all-zero row
    counts as balanced).

    Args:
        loads_per_rank: [..., num_ranks] non-negative loads.

    Returns:
        [...] float64.
    """
    loads = np.asarray(loads_per_rank, dtype=np.float64)
    mean = loads.mean(axis=-1)
    return np.where(mean > 0, loads.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)


def plan_expert_moves(old_physical_to_logical: np.ndarray, new_physical_to_logical: np.ndarray,
                      num_ranks: int) -> list[tuple[int, int]]:
    """The weight copies that turn one layer's placement `old` into `new`: a list of
    (dst, src) physical slots, meaning "slot dst takes the weights slot src holds under old".

    Slots whose logical expert does not change are left out. A slot's source is a copy of its
    new expert on its own rank when the old placement has one (a local copy, no traffic);
    otherwise the remote copy whose rank has been given the fewest sends so far (lowest slot
    on ties), so replicas share the sending. Every rank computes the same plan from the same
    maps, which is what lets the point-to-point transfers pair up without negotiation.

    Args:
        old_physical_to_logical, new_physical_to_logical: [P] int64 maps of one layer; rank r
            holds slots [r * P / num_ranks, (r + 1) * P / num_ranks).
        num_ranks: the EP group size (divides P).

    Raises:
        ValueError: maps of different lengths, a P not divisible by num_ranks, or a logical
            expert of `new` that `old` does not hold anywhere.
    """
    old = np.asarray(old_physical_to_logical, dtype=np.int64)
    new = np.asarray(new_physical_to_logical, dtype=np.int64)
    if old.shape != new.shape or old.ndim != 1 or old.size % num_ranks:
        raise ValueError(f"plan_expert_moves: maps of shapes {old.shape} / {new.shape} over "
                         f"{num_ranks} ranks")
    slots_per_rank = old.size // num_ranks
    copies: dict[int, list[int]] = {}
    for slot, logical in enumerate(old.tolist()):
        copies.setdefault(logical, []).append(slot)
    sends = [0] * num_ranks
    moves = []
    for dst, logical in enumerate(new.tolist()):
        if old[dst] == logical:
            continue
        if logical not in copies:
            raise ValueError(f"plan_expert_moves: logical expert {logical} has no old copy")
        rank = dst // slots_per_rank
        local = [s for s in copies[logical] if s // slots_per_rank == rank]
        if local:
            src = local[0]
        else:
            src = min(copies[logical], key=lambda s: (sends[s // slots_per_rank], s))
            sends[src // slots_per_rank] += 1
        moves.append((dst, src))
    return moves
