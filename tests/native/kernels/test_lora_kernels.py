"""The native CPU grouped LoRA kernels (csrc/cpu_lora.cpp) against the torch reference
(lora/ops.py): mixed adapters of ranks 4, 8 and 16 in slots of rank 16, base rows left alone,
a merged layer of three uneven slices and a plain one, float32 and bfloat16. (The Triton
kernels: tests/lora/test_lora_triton.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.lora.ops import LoRAMapping, lora_expand, lora_shrink
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.lora import (NativeLoRAStep, cpu_lora_expand, cpu_lora_shrink,
                                          lora_linear_weights)

MAX_RANK = 16
SLOT_RANKS = [4, 16, 8]
# batch row -> slot (-1: base row)
TOKEN_SLOTS = [2, -1, 0, 0, 2, -1, 1, 2, 0, -1, 1, 1, 2]


def _slots(slices: list[int], k: int, dtype: torch.dtype, seed: int):
    """Random A [slots, width, k] and B^T [slots, width, n] with each slot's rank's rows only
    (slice i's B^T rows only in its columns), as LoRALinear.set_lora writes them."""
    g = torch.Generator().manual_seed(seed)
    n, width = sum(slices), len(slices) * MAX_RANK
    lora_a = torch.zeros(len(SLOT_RANKS), width, k)
    lora_b = torch.zeros(len(SLOT_RANKS), width, n)
    for slot, rank in enumerate(SLOT_RANKS):
        offset = 0
        for i, size in enumerate(slices):
            rows = slice(i * MAX_RANK, i * MAX_RANK + rank)
            lora_a[slot, rows] = torch.randn(rank, k, generator=g)
            lora_b[slot, rows, offset:offset + size] = torch.randn(rank, size, generator=g)
            offset += size
    return lora_a.to(dtype), lora_b.to(dtype)


def _mapping(device: str = "cpu") -> LoRAMapping:
    slots = np.array(TOKEN_SLOTS)
    order = np.argsort(slots, kind="stable")[int((slots < 0).sum()):]
    counts = np.bincount(slots[slots >= 0], minlength=len(SLOT_RANKS))
    ends = np.cumsum(counts)
    segments = tuple((s, int(ends[s] - counts[s]), int(ends[s])) for s in range(len(counts)))
    native = NativeLoRAStep(order, np.array([(*seg, SLOT_RANKS[seg[0]]) for seg in segments]),
                            len(slots))
    return LoRAMapping(torch.from_numpy(order).to(device), segments, native,
                       torch.from_numpy(slots[order].astype(np.int32)).to(device))


CASES = [([72, 24, 24], 64), ([40], 136)]   # qkv-like merged slices (tails); one slice


@pytest.mark.skipif(cpu_kernels() is None, reason="no native kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices,k", CASES)
def test_native_shrink_expand_match_torch_reference(dtype, slices, k):
    lora_a, lora_b = _slots(slices, k, dtype, seed=k)
    mapping = _mapping()
    x = torch.randn(len(TOKEN_SLOTS), k).to(dtype)
    y = torch.randn(len(TOKEN_SLOTS), sum(slices)).to(dtype)
    weights = lora_linear_weights(lora_a, lora_b, list(np.cumsum(slices)), MAX_RANK)
    assert weights is not None
    # The reference in float32 on the same (rounded) values.
    want_shrunk = torch.cat(lora_shrink(x.float(), lora_a.float(), mapping))
    want = y.float().clone()
    lora_expand(want, list(want_shrunk.split([e - s for _, s, e in mapping.segments])),
                lora_b.float(), mapping)
    shrunk = cpu_lora_shrink(x, weights, mapping.native)
    # Only the columns each adapter's rank uses are computed.
    for slot, start, end in mapping.segments:
        for i in range(len(slices)):
            cols = slice(i * MAX_RANK, i * MAX_RANK + SLOT_RANKS[slot])
            torch.testing.assert_close(shrunk[start:end, cols], want_shrunk[start:end, cols],
                                       rtol=1e-5, atol=1e-4)
    got = y.clone()
    cpu_lora_expand(shrunk, weights, mapping.native, got)
    base_rows = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])               # base rows untouched
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(got.float(), want, **tol)



def test_step_rows_outside_the_batch_refused():
    with pytest.raises(ValueError, match="outside 2 adapter tokens of a 3-token batch"):
        NativeLoRAStep(np.array([0, 3]), np.array([[0, 0, 2, 4]]), 3)
    with pytest.raises(ValueError, match="outside"):
        NativeLoRAStep(np.array([0, 1]), np.array([[0, 0, 3, 4]]), 3)
