"""DeepSeek's rotary embedding: interleaved pairs, YaRN scaling with its mscale.

DeepSeek rotates the qk_rope_head_dim channels of q_pe / k_pe as interleaved pairs (x0, x1),
(x2, x3), ... (HF's DeepSeek-V2 complex multiply; DeepSeek-V3's `rope_interleave`, the
default), or as GPT-NeoX halves when `rope_interleave` is False. The interleaved result is
written de-interleaved, as HF's DeepSeek-V3:

    x = [x0 x1 x2 x3 ...]  ->  [x0 c0 - x1 s0, x2 c1 - x3 s1, ... | x1 c0 + x0 s0, x3 c1 + x2 s1, ...]

(a fixed permutation of HF V2's interleaved output, the same for q and k, so every q . k is
unchanged: the latent cache holds k_pe in this order.)

YaRN (Peng et al. 2023, arXiv:2309.00071) as transformers' `_compute_yarn_parameters`:
frequencies blended between interpolation (/ factor) and extrapolation by a linear ramp over
the correction range of beta_fast / beta_slow rotations in the original context, cos/sin scaled
by attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim); DeepSeek also
multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 (`deepseek_softmax_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_DEEPSEEK_ROPE_TYPES = ("default", "yarn")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a DeepSeek/GLM config dict (`rope_parameters`, or transformers 4's
    `rope_theta` / `rope_scaling`), with `rope_type` and `rope_theta` always set.

    Raises:
        ValueError: for a rope type other than "default" or "yarn", naming it.
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_DEEPSEEK_ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported for this "
                         f"model; supported: {SUPPORTED_DEEPSEEK_ROPE_TYPES}")
    params["rope_type"] = rope_type
    return params


def deepseek_softmax_scale(qk_head_dim: int, rope_parameters: dict[str, Any]) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with a non-zero
    `mscale_all_dim` (HF's `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    if rope_parameters["rope_type"] != "default" and mscale_all_dim:
        m = yarn_get_mscale(rope_parameters["factor"], mscale_all_dim)
        scale = scale * m * m
    return scale


def yarn_inv_freq(dim: int, params: dict[str, Any],
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [dim / 2], attention factor) of YaRN, as transformers."""
    base = float(params["rope_theta"])
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale)
                                     / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class DeepseekRotaryEmbedding(nn.Module):
    """RoPE on the qk_rope_head_dim channels of q_pe [n, H, dr] and k_pe [n, 1, dr].

    Args:
        rotary_dim: dr.
        max_position: positions covered by the tables.
        rope_parameters: from `deepseek_rope_parameters`.
        interleaved: pairs (x0, x1), (x2, x3), ... (DeepSeek) rather than halves.
    """

    def __init__(self, rotary_dim: int, max_position: int, rope_parameters: dict[str, Any],
                 interleaved: bool = True) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        if rope_parameters["rope_type"] == "yarn":
            inv_freq, attention_factor = yarn_inv_freq(rotary_dim, rope_parameters, max_position)
        else:
            inv_freq = 1.0 / (float(rope_parameters["rope_theta"]) ** (
                torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
            attention_factor = 1.0
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor,
                k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] int64 -> (q_pe, k_pe) rotated, same shapes and dtype (q_pe may come
        back as a view of a larger tensor)."""
        cos = self.cos_cache[positions].unsqueeze(1)                    # [n, 1, dr / 2]
        sin = self.sin_cache[positions].unsqueeze(1)
        if cos.dtype != q_pe.dtype:
            cos, sin = cos.to(q_pe.dtype), sin.to(q_pe.dtype)
        if k_pe.dtype == q_pe.dtype and k_pe.shape[0] == q_pe.shape[0]:
            # NOTE(batch-1): one rotation over the query heads and the key head together (the
            # same elementwise operations on every value): half the small ops of a decode
            # step's RoPE (docs/benchmarks.md, "Batch-1 decode of the 200M presets").
            heads = q_pe.shape[1]
            both = self._rotate(torch.cat((q_pe, k_pe), dim=1), cos, sin)
            return both[:, :heads], both[:, heads:]
        return self._rotate(q_pe, cos, sin), self._rotate(k_pe, cos, sin)
