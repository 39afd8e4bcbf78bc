"""StateCache: a recurrent layer's view of the state cache (the state-space twin of Attention).

A recurrent layer (Mamba-2's SSD mixer, LFM2's short convolution) keeps per request a fixed-size
state instead of a growing KV cache. Its tensors live in slots (core/state_cache_group_manager.py:
one slot per running request, slot 0 the null slot) and are bound here by the worker:

    states[i]: [num_slots, *state_shapes[i]]   e.g. conv window [num_slots, C, K - 1] and
                                                SSM state [num_slots, H, P, N]

Each step's `StateCacheMetadata` (built once per step by the runner from the state group's block
table) tells the layer which slot each request owns, where its tokens sit in the flat batch, and
whether its state continues a computed prefix (`num_computed_tokens > 0`) or starts from zero (a
new request, or one recomputed after preemption). Like `layers/attention.py` this module reads
the forward context; the models never do.

Prefix-caching mode "align" (core/state_cache_group_manager.py): the state group's block table
row is position-aligned, and a request's slot for a step is the entry of its last token,
(seq_len - 1) // block_size. Where that differs from the entry its computed prefix ended in,
(num_computed - 1) // block_size, the step starts by copying that slot into the new one
(`copy_src` -> `copy_dst`, `copy_state_slots`; the runner does it once per step for all
layers), so the old entry keeps the state at its block's end as a checkpoint. The block
boundaries a step passes inside its query (a long prefill) are checkpointed too: the scans emit
the state after each boundary's last token into that entry's slot where the scheduler gave the
entry one (`emit_*`; a null entry, slot 0, is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.metadata import CommonAttentionMetadata, KVCacheGroupsMetadata


@dataclass(frozen=True)
class StateCacheMetadata:
    """One step's facts for the recurrent layers.

    Attributes:
        state_indices: [num_reqs] int64 on the device, each request's state slot.
        has_initial_state: [num_reqs] bool on the device, whether the slot holds the state after
            the request's computed tokens (False: start from zeros).
        query_start_loc: [num_reqs + 1] int64 on the device, cumulative query lengths.
        query_start_loc_cpu: [num_reqs + 1] int64 numpy, the same.
        token_req_index: [num_tokens] int64 on the device, the request of each token.
        token_offset: [num_tokens] int64 on the device, each token's index inside its query.
        decode_reqs / prefill_reqs: int64 numpy, requests with one query token / more.
        num_reqs, num_tokens, max_query_len: ints.
        copy_src / copy_dst: [num_copies] int64 on the device, slots to copy before the step
            (mode "align"; empty otherwise).
        emit_start: [num_reqs + 1] int64 on the device, each request's run of the emit arrays
            (mode "align": the block boundaries inside its query; all zeros otherwise);
            emit_start_cpu the same as numpy.
        emit_offset: [num_emits] int64 on the device, ascending inside a request: the index in
            its query of a block's last token; the state after it is also written to ...
        emit_slot: [num_emits] int64 on the device, ... this slot (the block's entry; 0, the
            null slot, means none and is skipped).
        emit_token: [num_emits] int64 on the device, the same tokens' flat indices.
    """

    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: np.ndarray
    token_req_index: torch.Tensor
    token_offset: torch.Tensor
    decode_reqs: np.ndarray
    prefill_reqs: np.ndarray
    num_reqs: int
    num_tokens: int
    max_query_len: int
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    emit_start: torch.Tensor
    emit_start_cpu: np.ndarray
    emit_offset: torch.Tensor
    emit_slot: torch.Tensor
    emit_token: torch.Tensor

    @property
    def num_emits(self) -> int:
        return int(self.emit_start_cpu[-1])

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata,
                    align: bool = False) -> StateCacheMetadata:
        """Built from the state group's common metadata: its block table's column 0 is each
        request's slot, or (`align`, mode "align") column (seq_len - 1) // block_size, after a
        copy from column (num_computed - 1) // block_size where that differs; then the entries
        j of the boundaries (j + 1) * block_size inside the query, after the one it reads and
        before the one it writes, are emitted (`emit_*`)."""
        r = common.num_reqs
        qsl = common.query_start_loc_cpu[:r + 1].astype(np.int64)
        query_lens = np.diff(qsl)
        seq_lens = common.seq_lens_cpu[:r].astype(np.int64)
        num_computed = seq_lens - query_lens
        req_index = np.repeat(np.arange(r, dtype=np.int64), query_lens)
        offset = np.arange(int(qsl[-1]), dtype=np.int64) - qsl[req_index]
        device = common.block_table.device

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        table = common.block_table[:r].to(torch.int64)
        rows = np.arange(r, dtype=np.int64)
        write = (seq_lens - 1) // common.block_size if align else np.zeros(r, np.int64)
        read = np.maximum(num_computed - 1, 0) // common.block_size if align else write
        copy = np.nonzero((num_computed > 0) & (read != write))[0].astype(np.int64)
        bs = common.block_size
        first = -(-num_computed // bs)                      # the first entry after `read`
        counts = np.maximum(write - first, 0) if align else np.zeros(r, np.int64)
        emit_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        emit_req = np.repeat(rows, counts)
        emit_col = (np.arange(int(emit_start[-1]), dtype=np.int64) - emit_start[emit_req]
                    + first[emit_req])
        emit_offset = (emit_col + 1) * bs - 1 - num_computed[emit_req]
        state_indices = table[dev(rows), dev(write)] if align else table[:, 0]
        return cls(state_indices=state_indices,
                   has_initial_state=dev(num_computed > 0), query_start_loc=dev(qsl),
                   query_start_loc_cpu=qsl, token_req_index=dev(req_index),
                   token_offset=dev(offset),
                   decode_reqs=np.nonzero(query_lens == 1)[0].astype(np.int64),
                   prefill_reqs=np.nonzero(query_lens > 1)[0].astype(np.int64),
                   num_reqs=r, num_tokens=int(qsl[-1]),
                   max_query_len=int(query_lens.max()) if r else 0,
                   copy_src=table[dev(copy), dev(read[copy])],
                   copy_dst=table[dev(copy), dev(write[copy])],
                   emit_start=dev(emit_start), emit_start_cpu=emit_start,
                   emit_offset=dev(emit_offset), emit_slot=table[dev(emit_req), dev(emit_col)],
                   emit_token=dev(qsl[emit_req] + emit_offset))


def copy_state_slots(states: list[torch.Tensor], meta: StateCacheMetadata) -> None:
    """Copy slots `meta.copy_src` into `meta.copy_dst` in every state tensor ([num_slots, ...]
    each), before a step of mode "align" (no-op when there are none)."""
    if meta.copy_src.numel() == 0:
        return
    for t in states:
        t.index_copy_(0, meta.copy_dst, t.index_select(0, meta.copy_src))


def emitted_slots(meta: StateCacheMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(emit indices, slots) of the step's emits that have a slot (not the null slot 0), for
    the torch references (a host sync on a GPU)."""
    keep = torch.nonzero(meta.emit_slot != 0).squeeze(1)
    return keep, meta.emit_slot[keep]


class StateCache(nn.Module):
    """The state tensors of one recurrent layer and the step's metadata.

    Args:
        state_shapes: the per-request shape of each state tensor (without the slot dim).
        state_dtypes: each tensor's dtype.
        layer_name: for messages (e.g. "model.layers.0.conv").
    """

    def __init__(self, state_shapes: tuple[tuple[int, ...], ...],
                 state_dtypes: tuple[torch.dtype, ...], layer_name: str) -> None:
        super().__init__()
        if len(state_shapes) != len(state_dtypes):
            raise ValueError(f"{layer_name}: {len(state_shapes)} state shapes, "
                             f"{len(state_dtypes)} dtypes")
        self.state_shapes = tuple(tuple(s) for s in state_shapes)
        self.state_dtypes = tuple(state_dtypes)
        self.layer_name = layer_name
        # Bound by the worker (worker/state_cache.py): [num_slots, *state_shapes[i]] each.
        self.states: list[torch.Tensor] = []

    def bytes_per_slot(self) -> int:
        """Bytes of one request's states in this layer."""
        return sum(int(np.prod(s)) * torch.empty(0, dtype=d).element_size()
                   for s, d in zip(self.state_shapes, self.state_dtypes))

    @staticmethod
    def metadata() -> StateCacheMetadata:
        """This step's metadata (from the forward context).

        Raises:
            RuntimeError: outside a forward, or when the engine set up no state group.
        """
        attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, KVCacheGroupsMetadata):
            for m in attn_metadata.group_metadata:
                if isinstance(m, StateCacheMetadata):
                    return m
        raise RuntimeError("a recurrent layer ran without a state cache group")
