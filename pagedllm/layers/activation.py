"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])


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


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the sigmoid approximation of GELU (Hendrycks & Gimpel 2016, sec. 2),
    HF's `quick_gelu` (CLIP's and Qwen2-VL's vision towers)."""
    return x * torch.sigmoid(1.702 * x)


_ACT_FNS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
            "quick_gelu": quick_gelu, "silu": F.silu}


def get_act_fn(name: str):
    """The elementwise activation an HF config's `hidden_act` names (a function of a tensor).

    Raises:
        ValueError: for a name not implemented here, listing the implemented ones.
    """
    if name not in _ACT_FNS:
        raise ValueError(f"unsupported hidden_act {name!r}; implemented: {sorted(_ACT_FNS)}")
    return _ACT_FNS[name]
