"""Slices of lazy checkpoint tensors (safetensors and GGUF alike): `narrow` without reading."""

from __future__ import annotations

import torch


def narrow_index(shape: torch.Size, index: tuple[slice, ...] | None, dim: int, start: int,
                 length: int, what: str) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """The (shape, index into the whole tensor) of `narrow(dim, start, length)` applied to a
    lazy tensor of `shape` that is already the slice `index` (None = the whole tensor).

    Raises:
        ValueError: the slice is outside the tensor (`what` names it in the message).
    """
    dim = dim % len(shape)
    if start < 0 or length < 0 or start + length > shape[dim]:
        raise ValueError(f"slice [{start}, {start + length}) outside dimension {dim} of "
                         f"{what} {tuple(shape)}")
    new_index = list(index or (slice(0, s) for s in shape))
    base = new_index[dim].start
    new_index[dim] = slice(base + start, base + start + length)
    new_shape = list(shape)
    new_shape[dim] = length
    return tuple(new_shape), tuple(new_index)
