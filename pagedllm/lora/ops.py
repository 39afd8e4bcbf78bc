"""Punica-style grouped LoRA products (S-LoRA / Punica: Sheng et al. 2023, Chen et al. 2023),
torch reference.

The step's adapter tokens are sorted by slot once per step (`LoRAMapping`, built by the
manager); per layer they are gathered once, each slot's contiguous segment is multiplied by its
A^T (shrink, to the slot's width) and B^T (expand), and the results are added back in one
scatter. Base tokens (no adapter) are in no segment and get nothing added.

    lora_a: [max_loras, num_slices * max_lora_rank, in_features]   (slot-major, zero-padded)
    lora_b: [max_loras, out_features, num_slices * max_lora_rank]  (slice i's rows use only
                                                                    columns of slice i)

    token_indices: [ t(slot 0) ... | t(slot 2) ... | ... ]   segments: (slot, start, end)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAMapping:
    """One step's adapter tokens by slot.

    Attributes:
        token_indices: [m] int64 on the device, the batch positions of the adapter tokens
            sorted by slot (stable); None when every token of the batch has the same slot (then
            the segment covers the batch in order, with no gather or scatter).
        segments: (slot, start, end) per slot in use: its tokens are
            token_indices[start:end].
    """

    token_indices: torch.Tensor | None
    segments: tuple[tuple[int, int, int], ...]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping
                ) -> list[torch.Tensor]:
    """Each segment's rows of `x` [n, in_features] times its slot's A^T.

    Returns:
        One [end - start, num_slices * max_lora_rank] tensor per segment, in order.
    """
    rows = x if mapping.token_indices is None else x.index_select(0, mapping.token_indices)
    return [rows[start:end] @ lora_a[slot].t() for slot, start, end in mapping.segments]


def lora_expand(y: torch.Tensor, shrunk: list[torch.Tensor], lora_b: torch.Tensor,
                mapping: LoRAMapping) -> None:
    """Add each segment's `shrunk` rows times its slot's B^T into its tokens' rows of `y`
    [n, out_features] (in place)."""
    deltas = [t @ lora_b[slot].t() for (slot, _, _), t in zip(mapping.segments, shrunk)]
    delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
    if mapping.token_indices is None:
        y.add_(delta)
    else:
        y.index_add_(0, mapping.token_indices, delta)
