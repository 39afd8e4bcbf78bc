"""Punica-style grouped LoRA products (S-LoRA / Punica: Sheng et al. 2023, Chen et al. 2023):
the torch reference, and `add_lora`, which picks the kernel per device (the native CPU kernels
of `native/kernels/lora.py`, the Triton kernels of `lora/triton_ops.py` on CUDA, else this
reference).

The step's adapter tokens are sorted by slot once per step (`LoRAMapping`, built by the
manager); per layer they are gathered once, each slot's contiguous segment is multiplied by its
A^T (shrink, to the slot's width) and B^T (expand), and the results are added back in one
scatter. Base tokens (no adapter) are in no segment and get nothing added.

    lora_a: [max_loras, num_slices * max_lora_rank, in_features]   (slot-major, zero-padded)
    lora_b: [max_loras, num_slices * max_lora_rank, out_features]  (B^T per slot: slice i's
                                                                    rows fill only its columns)

    token_indices: [ t(slot 0) ... | t(slot 2) ... | ... ]   segments: (slot, start, end)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.native.kernels.lora import (LoRALinearWeights, NativeLoRAStep, cpu_lora_expand,
                                         cpu_lora_shrink, cpu_lora_supported)


@dataclass(frozen=True)
class LoRAMapping:
    """One step's adapter tokens by slot.

    Attributes:
        token_indices: [m] int64 on the device, the batch positions of the adapter tokens
            sorted by slot (stable); None when every token of the batch has the same slot (then
            the segment covers the batch in order, with no gather or scatter).
        segments: (slot, start, end) per slot in use: its tokens are
            token_indices[start:end].
        native: the same on the host for the native kernels (token rows always listed, each
            segment with its adapter's rank), or None.
        token_slots: [m] int32 on the device, the slot of each of token_indices' tokens, for
            the Triton kernels (None off CUDA).
        batch_slots: [n] int64 on the device, the slot of every token of the batch (-1: the
            base model), for the MoE experts' wrappers (lora/moe.py) and the embedding and
            LM head adapters (lora/vocab.py); None for a model without them.
    """

    token_indices: torch.Tensor | None
    segments: tuple[tuple[int, int, int], ...]
    native: NativeLoRAStep | None = None
    token_slots: torch.Tensor | None = None
    batch_slots: torch.Tensor | None = None


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
    deltas = [t @ lora_b[slot] for (slot, _, _), t in zip(mapping.segments, shrunk)]
    delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
    if mapping.token_indices is None:
        y.add_(delta)
    else:
        y.index_add_(0, mapping.token_indices, delta)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             native: LoRALinearWeights | None, mapping: LoRAMapping, max_rank: int,
             slice_ends: tuple[int, ...]) -> None:
    """y += per token x A_s^T B_s^T for the mapping's adapter tokens (in place), on the native
    CPU kernels where they take the operands (`native`: the layer's slots for them), the Triton
    kernels on CUDA, else the torch reference.

    Args:
        x: [n, in_features] the layer's input; y: [n, out_features] its output.
        lora_a, lora_b: the layer's slots (module docstring).
        max_rank, slice_ends: the slots' width per slice and the slices' output ends.
    """
    if native is not None and mapping.native is not None \
            and cpu_lora_supported(x, y, native, mapping.native):
        cpu_lora_expand(cpu_lora_shrink(x, native, mapping.native), native, mapping.native, y)
    elif y.is_cuda and mapping.token_slots is not None:
        from pagedllm.lora.triton_ops import triton_lora_shrink_expand
        triton_lora_shrink_expand(x, y, lora_a, lora_b, mapping, max_rank, slice_ends)
    else:
        lora_expand(y, lora_shrink(x, lora_a, mapping), lora_b, mapping)
