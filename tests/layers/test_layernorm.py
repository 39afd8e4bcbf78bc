"""RMSNorm and GemmaRMSNorm: the float32 form (fewer dispatches, in-place scalar ops) equals the
general formula bit for bit, with and without the residual add."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm


def _reference(cls, weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if cls is RMSNorm:
        return weight * normed.to(x.dtype)
    return (normed * (1.0 + weight.float())).to(x.dtype)


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("shape", [(1, 768), (5, 512), (3, 4, 64), (2, 100)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_equals_reference_formula(cls, shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    norm = cls(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=g).to(dtype)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    residual = torch.randn(*shape, generator=g).to(dtype)
    assert torch.equal(norm(x), _reference(cls, norm.weight, x, 1e-6))
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, _reference(cls, norm.weight, x + residual, 1e-6))
    assert out.dtype == dtype and out.shape == x.shape
