"""Python entry points of the grouped LoRA kernels (Punica / S-LoRA: Chen et al. 2023, Sheng et
al. 2023): `csrc/lora_kernel.h`, run on their own by `csrc/cpu_lora.cpp` (the module path) or
inside the fused decoder layer (`csrc/cpu_decoder.cpp`).

A step's adapter tokens are described once (`NativeLoRAStep`: the batch rows sorted by adapter
slot, and per slot a segment with the adapter's rank); each wrapped linear layer's slots once
(`lora_linear_weights`: pointers to its A and B^T buffers and its output slices). The layouts
are in the header of `csrc/lora_kernel.h`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.native.kernels import abi, cpu_kernels

LoRALinearWeights = abi.struct("LoRALinearWeights")
LoRAStepArgs = abi.struct("LoRAStepArgs")

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class NativeLoRAStep:
    """One step's adapter tokens for the native kernels (host arrays and their `LoRAStepArgs`).

    Args:
        token_indices: [m] int64, the batch rows of the adapter tokens, sorted by slot.
        segments: [s, 4] int64 rows (slot, start, end, rank): token_indices[start:end] take
            slot `slot`, whose adapter has rank `rank`.
        batch_tokens: tokens of the batch the rows index (every index is below it).

    Raises:
        ValueError: a segment outside token_indices or a row outside the batch.
    """

    def __init__(self, token_indices: np.ndarray, segments: np.ndarray,
                 batch_tokens: int) -> None:
        self.token_indices = np.ascontiguousarray(token_indices, dtype=np.int64)
        self.segments = np.ascontiguousarray(segments, dtype=np.int64).reshape(-1, 4)
        self.batch_tokens = batch_tokens
        m = len(self.token_indices)
        if (self.segments[:, 1:3].min(initial=0) < 0 or self.segments[:, 2].max(initial=0) > m
                or (m and not 0 <= self.token_indices.min() <= self.token_indices.max()
                    < batch_tokens)):
            raise ValueError(f"LoRA step: segments {self.segments.tolist()} or token rows "
                             f"outside {m} adapter tokens of a {batch_tokens}-token batch")
        self.num_lora_tokens = int(self.segments[:, 2].max(initial=0))
        self.args = LoRAStepArgs(token_indices=self.token_indices.ctypes.data,
                                 segments=self.segments.ctypes.data,
                                 num_segments=len(self.segments))

    @property
    def address(self) -> int:
        """The address of its `LoRAStepArgs` (valid while this object lives)."""
        return ctypes.addressof(self.args)


def lora_linear_weights(lora_a: torch.Tensor, lora_b: torch.Tensor, slice_ends: Sequence[int],
                        max_rank: int) -> LoRALinearWeights | None:
    """The native description of one linear layer's adapter slots, or None where the kernels
    do not take them (not on the CPU, not float32/bfloat16, not contiguous, more than three
    slices, no built kernels). The struct points into the tensors: keep them alive and never
    replace their storage.

    Args:
        lora_a: [max_loras, num_slices * max_rank, in_features].
        lora_b: [max_loras, num_slices * max_rank, out_features] (B^T per slot).
        slice_ends: each slice's end among the output columns (the last = out_features).
        max_rank: the slots' width per slice.
    """
    if (cpu_kernels() is None or not 1 <= len(slice_ends) <= 3
            or any(t.device.type != "cpu" or t.dtype not in _DTYPE_CODES
                   or not t.is_contiguous() for t in (lora_a, lora_b))
            or lora_a.dtype != lora_b.dtype or lora_a.shape[1] != len(slice_ends) * max_rank
            or lora_b.shape[:2] != lora_a.shape[:2] or slice_ends[-1] != lora_b.shape[2]):
        return None
    ends = list(slice_ends) + [slice_ends[-1]] * (3 - len(slice_ends))
    return LoRALinearWeights(lora_a=lora_a.data_ptr(), lora_b=lora_b.data_ptr(),
                             dtype=_DTYPE_CODES[lora_a.dtype], in_features=lora_a.shape[2],
                             out_features=lora_b.shape[2], max_rank=max_rank,
                             num_slices=len(slice_ends), slice_end=(ctypes.c_int64 * 3)(*ends))


def cpu_lora_supported(x: torch.Tensor, y: torch.Tensor, weights: LoRALinearWeights,
                       step: NativeLoRAStep) -> bool:
    """Whether `cpu_lora_shrink` / `cpu_lora_expand` take these operands: CPU float32/bfloat16
    2-D x [n, in_features] and y [n, out_features] with unit column stride, n the step's batch."""
    return all(t.device.type == "cpu" and t.dtype in _DTYPE_CODES and t.dim() == 2
               and t.stride(1) == 1 and t.shape[0] == step.batch_tokens for t in (x, y)) \
        and x.shape[1] == weights.in_features and y.shape[1] == weights.out_features


def cpu_lora_shrink(x: torch.Tensor, weights: LoRALinearWeights, step: NativeLoRAStep
                    ) -> torch.Tensor:
    """Per segment, x[tokens] @ A[slot]^T.

    Args:
        x: [batch_tokens, in_features] float32 or bfloat16, unit column stride.

    Returns:
        shrunk: [num_lora_tokens, num_slices * max_rank] float32, row i for token_indices[i]
            (in each slice, columns beyond the segment's rank are unset: expand never reads
            them).

    Raises:
        ValueError: an unsupported dtype.
    """
    width = weights.num_slices * weights.max_rank
    shrunk = torch.zeros(step.num_lora_tokens, width, dtype=torch.float32)
    code = _DTYPE_CODES.get(x.dtype, -1)
    if cpu_kernels().lora_shrink(x.data_ptr(), x.stride(0), code, ctypes.byref(weights),
                                 step.address, shrunk.data_ptr()) != 0:
        raise ValueError(f"lora_shrink: activations {x.dtype} or adapter dtype code "
                         f"{weights.dtype} not taken (float32 or bfloat16)")
    return shrunk


def cpu_lora_expand(shrunk: torch.Tensor, weights: LoRALinearWeights, step: NativeLoRAStep,
                    y: torch.Tensor) -> None:
    """y[tokens] += shrunk @ B[slot]^T per segment, slice by slice, in place (math in float32,
    y rounded once).

    Args:
        shrunk: `cpu_lora_shrink`'s result, float32 contiguous.
        y: [batch_tokens, out_features] float32 or bfloat16, unit column stride.

    Raises:
        ValueError: an unsupported dtype.
    """
    code = _DTYPE_CODES.get(y.dtype, -1)
    if cpu_kernels().lora_expand(shrunk.data_ptr(), ctypes.byref(weights), step.address,
                                 y.data_ptr(), y.stride(0), code) != 0:
        raise ValueError(f"lora_expand: output {y.dtype} or adapter dtype code "
                         f"{weights.dtype} not taken (float32 or bfloat16)")
