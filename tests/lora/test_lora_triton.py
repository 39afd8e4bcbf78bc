"""The Triton grouped LoRA kernels (lora/triton_ops.py) against the torch reference
(lora/ops.py), with the cases of tests/native/kernels/test_lora_kernels.py: mixed adapters of
ranks 4, 8 and 16 in rank-16 slots, base rows, a merged layer of three uneven slices and a
plain one, float32 and bfloat16.

On a GPU the kernels run compiled on CUDA tensors; without one, in triton's interpreter: this
module imports triton and the kernel module with TRITON_INTERPRET=1 and restores the
environment right after, as tests/attention/test_triton_paged.py does (skipped if triton was
imported in this process before without it).
"""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest
import torch

from pagedllm.lora.ops import lora_expand, lora_shrink
from tests.native.kernels.test_lora_kernels import CASES, MAX_RANK, TOKEN_SLOTS, _mapping, _slots

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _import_kernels():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        module = importlib.import_module("pagedllm.lora.triton_ops")
        if DEVICE.type == "cpu" and not (isinstance(triton.language.zeros, InterpretedFunction)
                                         and module.INTERPRETED):
            pytest.skip("triton was imported in this process before without TRITON_INTERPRET=1; "
                        "run this module in its own process", allow_module_level=True)
        # The first launch imports more of triton under the setting (see test_triton_paged).
        _run(module, *CASES[1], torch.float32)
    return module


def _run(module, slices, k, dtype):
    """(the kernels' y, the reference's y in float32, y before) on random operands."""
    lora_a, lora_b = _slots(slices, k, dtype, seed=k)
    lora_a, lora_b = lora_a.to(DEVICE), lora_b.to(DEVICE)
    mapping = _mapping(DEVICE.type)
    x = torch.randn(len(TOKEN_SLOTS), k).to(dtype).to(DEVICE)
    y = torch.randn(len(TOKEN_SLOTS), sum(slices)).to(dtype).to(DEVICE)
    want = y.float().clone()
    lora_expand(want, lora_shrink(x.float(), lora_a.float(), mapping), lora_b.float(), mapping)
    got = y.clone()
    module.triton_lora_shrink_expand(x, got, lora_a, lora_b, mapping, MAX_RANK,
                                     tuple(np.cumsum(slices).tolist()))
    return got, want, y


KERNELS = _import_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices,k", CASES)
def test_triton_shrink_expand_match_torch_reference(dtype, slices, k):
    got, want, y = _run(KERNELS, slices, k, dtype)
    base_rows = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])               # base rows untouched
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(got.float(), want, **tol)
