"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """GeGLU gate (Shazeer 2020): x = [gate | up] along the last dim -> gelu(gate) * up.

    Args:
        approximate: "tanh" (HF's `gelu_pytorch_tanh`, Gemma) or "none" (exact erf GELU).

    Raises:
        ValueError: for another `approximate`.
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GeluAndMul: approximate must be 'tanh' or 'none', got "
                             f"{approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
