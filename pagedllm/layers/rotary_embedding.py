"""Rotary position embedding (Su et al. 2021, RoFormer), GPT-NeoX layout as in HF Llama.

Supported scalings: none ("default"), "linear" (Chen et al. 2023, position interpolation) and
"llama3" (Meta's Llama 3.1 frequency-dependent scaling). cos/sin are precomputed for every position
up to `max_position` in float32; `forward` gathers them by `positions`.

    x = [x1 | x2] (halves of head_size);  out = [x1*cos - x2*sin | x2*cos + x1*sin]
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_parameters_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Read RoPE settings from an HF config dict (transformers 4 `rope_theta`/`rope_scaling` or
    transformers 5 `rope_parameters`). Returns a dict with `rope_type` and `rope_theta`.

    Raises:
        ValueError: for a rope type this engine does not implement, naming it.
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    params["rope_type"] = rope_type
    return params


class RotaryEmbedding(nn.Module):
    """Apply RoPE to query and key.

    Args:
        head_size: size of each head (the whole head is rotated).
        max_position: positions covered by the cache.
        rope_parameters: from `rope_parameters_from_hf`.
    """

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        base = float(rope_parameters["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float()
                                   / head_size))
        rope_type = rope_parameters["rope_type"]
        if rope_type == "linear":
            inv_freq = inv_freq / float(rope_parameters["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                             # [max_position, head_size/2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] int64; query [n, H, D]; key [n, KVH, D] -> rotated (same shapes/dtype)."""
        cos = self.cos_cache[positions][:, None, :].to(query.dtype)   # [n, 1, D/2]
        sin = self.sin_cache[positions][:, None, :].to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
