"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add; LayerNorm (BERT)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader


def _scaled_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) for float32 x [..., D]: a new tensor, the same ops and
    roundings as the general form without its no-op casts and with the scalar add and rsqrt in
    place (a decode step runs 25-40 norms of one row, where each dispatch costs more than the
    arithmetic: docs/benchmarks.md, "Batch-1 decode")."""
    return x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as HF Llama does.

    forward(x) -> y; forward(x, residual) -> (y, x + residual) where the sum is the new residual.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return _scaled_rms(x, self.eps).mul_(self.weight)   # = weight * normed, bit for bit
        orig = x.dtype
        if orig != torch.float32 and self.weight.dtype == orig:
            # NOTE(bf16-norm): the general form below with its products in place (x.float()
            # is a new tensor here): the same roundings, two fewer [n, D] allocations and
            # passes (docs/benchmarks.md, "Image prompts in bfloat16").
            x32 = x.float()
            x32.mul_(x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_())
            return x32.to(orig).mul_(self.weight)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(orig)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, cast back last.

    The checkpoint stores the zero-centred weight; the product is taken before the cast to the
    model dtype (Llama's RMSNorm casts first). forward(x) -> y;
    forward(x, residual) -> (y, x + residual) where the sum is the new residual. Shapes:
    [..., hidden_size], any float dtype (the output keeps x's dtype).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return _scaled_rms(x, self.eps).mul_(1.0 + self.weight.float())
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (Ba et al. 2016; BERT).

    forward(x [n, hidden_size]) -> [n, hidden_size], same dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
