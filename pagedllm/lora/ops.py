"""Punica-style grouped LoRA products (S-LoRA / Punica: Sheng et al. 2023, Chen et al. 2023),
torch reference.

A step's tokens are grouped by the adapter slot of their request (`LoRAStepState.groups`,
built once per step); per group, shrink = x A^T (to the slot's rank) and expand = y += (x A^T)
B^T. Base tokens (slot -1) are in no group and get nothing added.

    lora_a: [max_loras, num_slices * max_lora_rank, in_features]   (slot-major, zero-padded)
    lora_b: [max_loras, out_features, num_slices * max_lora_rank]  (slice i's rows use only
                                                                    columns of slice i)
"""

from __future__ import annotations

import torch

# (slot, token indices [m] int64 on the device, or None when the slot covers every token)
LoRAGroups = tuple[tuple[int, torch.Tensor | None], ...]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, groups: LoRAGroups
                ) -> list[torch.Tensor]:
    """Per group, its tokens' rows of `x` [n, in_features] times its slot's A^T.

    Returns:
        One [m, num_slices * max_lora_rank] tensor per group, in `groups`' order.
    """
    out = []
    for slot, index in groups:
        rows = x if index is None else x.index_select(0, index)
        out.append(rows @ lora_a[slot].t())
    return out


def lora_expand(y: torch.Tensor, shrunk: list[torch.Tensor], lora_b: torch.Tensor,
                groups: LoRAGroups) -> None:
    """Add each group's `shrunk` rows times its slot's B^T into its tokens' rows of `y`
    [n, out_features] (in place)."""
    for (slot, index), t in zip(groups, shrunk):
        delta = t @ lora_b[slot].t()
        if index is None:
            y.add_(delta)
        else:
            y.index_add_(0, index, delta)
