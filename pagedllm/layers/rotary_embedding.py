"""Rotary position embedding (Su et al. 2021, RoFormer), GPT-NeoX layout as in HF Llama.

Supported scalings: none ("default"), "linear" (Chen et al. 2023, position interpolation),
"llama3" (Meta's Llama 3.1 frequency-dependent scaling) and "longrope" (Phi-3's LongRoPE, alias
"su": per-frequency short/long factors and an attention factor folded into cos/sin). cos/sin are
precomputed for every position up to `max_position` in float32; `forward` gathers them by
`positions`. With `partial_rotary_factor` < 1 only the first `rotary_dim` channels rotate.

    x = [x1 | x2 | pass] (x1, x2: halves of rotary_dim);
    out = [x1*cos - x2*sin | x2*cos + x1*sin | pass]

LongRoPE caches two tables, rows [0, max_position) with the short factors and rows
[max_position, 2*max_position) with the long ones; the caller picks the long table by adding
`long_position_offset` to a token's position (see `models/phi3.py` for when).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


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


def _longrope_factors(params: dict[str, Any]) -> tuple[float, float]:
    """(scaling factor, attention factor) of LongRoPE as HF's `_compute_longrope_parameters`:
    the factor defaults to max_position_embeddings / original_max_position_embeddings (Phi-3
    stores the extended length, not a factor) and the attention factor to
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), 1 when factor <= 1."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return factor, attention_factor


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """Unscaled RoPE inverse frequencies, float32 [rotary_dim / 2]: base^(-2i/rotary_dim)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def rope_parameters_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Read RoPE settings from an HF config dict (transformers 4 `rope_theta`/`rope_scaling` or
    transformers 5 `rope_parameters`). Returns a dict with `rope_type`, `rope_theta` and
    `partial_rotary_factor` (1.0 unless the config sets it); for "longrope" (or its old name
    "su") also `original_max_position_embeddings` and `max_position_embeddings`, read from the
    top level of the config when the scaling dict lacks them (Phi-3's spelling).

    Raises:
        ValueError: for a rope type this engine does not implement, naming it, or a
            `partial_rotary_factor` outside (0, 1] (more channels than a head has).
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0) or 1.0)
    factor = params["partial_rotary_factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1] (the share of each "
                         f"head's channels that rotate), got {factor!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "su":
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "longrope":
        params.setdefault("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings"))
        params.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
    params["rope_type"] = rope_type
    return params


def scaled_inv_freq(rotary_dim: int, rope_parameters: dict[str, Any],
                    long: bool = False) -> torch.Tensor:
    """The inverse frequencies, float32 [rotary_dim / 2], after the configured scaling (for
    "longrope", with the long factors when `long`, else the short ones).

    Raises:
        ValueError: if a LongRoPE factor list does not have rotary_dim / 2 entries.
    """
    inv_freq = default_inv_freq(rotary_dim, float(rope_parameters["rope_theta"]))
    rope_type = rope_parameters["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_parameters)
    if rope_type == "longrope":
        key = "long_factor" if long else "short_factor"
        ext = torch.tensor(rope_parameters[key], dtype=torch.float32)
        if ext.shape != inv_freq.shape:
            raise ValueError(f"longrope {key} has {ext.numel()} entries, expected "
                             f"{inv_freq.numel()} (rotary_dim / 2)")
        return inv_freq / ext
    return inv_freq


def check_rope_freq_factors(factors: torch.Tensor, rotary_dim: int,
                            rope_parameters: dict[str, Any]) -> None:
    """Check llama.cpp's RoPE frequency factors (a GGUF file's `rope_freqs.weight`, which
    llama.cpp divides each unscaled frequency by) against the scaling this RoPE computes from
    the config: factors[i] must equal default_inv_freq[i] / scaled_inv_freq[i] (rtol 1e-4, or
    twice the resolution of `factors`' dtype when coarser, e.g. bfloat16).

    Args:
        factors: float [rotary_dim / 2].
        rotary_dim: rotated channels per head.
        rope_parameters: from `rope_parameters_from_hf`.

    Raises:
        ValueError: on a length mismatch, or naming the first differing factor and the config's
            rope type when the factors describe another scaling.
    """
    rtol = max(1e-4, 2 * torch.finfo(factors.dtype).eps)
    factors = factors.to(torch.float32).flatten()
    base = default_inv_freq(rotary_dim, float(rope_parameters["rope_theta"]))
    expected = base / scaled_inv_freq(rotary_dim, rope_parameters)
    if factors.shape != expected.shape:
        raise ValueError(f"rope_freqs has {factors.numel()} factors, expected {expected.numel()} "
                         f"(rotary_dim / 2)")
    bad = (~torch.isclose(factors, expected, rtol=rtol, atol=0)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"GGUF tensor rope_freqs.weight does not match the config's RoPE scaling "
            f"(rope_type {rope_parameters['rope_type']!r}): factor {i} is {float(factors[i])!r}, "
            f"the config gives {float(expected[i])!r}; RoPE frequency factors that the config "
            f"does not describe are not supported")


# Llama 3.x RoPE scaling as released (factor 8 or 32, low 1, high 4, original 8192), plus the
# powers of two other models and tests use for the original context.
_LLAMA3_LOW_HIGH = ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (0.5, 4.0), (2.0, 8.0))
_LLAMA3_ORIGINAL_LENGTHS = tuple(2 ** k for k in range(17, 5, -1))


def infer_llama3_rope_parameters(factors: torch.Tensor, rotary_dim: int,
                                 rope_theta: float) -> dict[str, Any] | None:
    """The llama3 `rope_parameters` that give llama.cpp's frequency factors (a Llama 3.1+ GGUF
    file's `rope_freqs.weight`, which the file's metadata does not describe otherwise), or None
    when no released setting reproduces them.

    The factor is the largest stored factor; low/high frequency factors and the original context
    are searched over the released settings, and a candidate counts only when every factor matches
    (`check_rope_freq_factors`). Any parameters that reproduce every factor give the same RoPE,
    since RoPE reads only the per-frequency values.

    Args:
        factors: float [rotary_dim / 2].
        rotary_dim: rotated channels per head.
        rope_theta: the RoPE base.
    """
    factor = float(factors.float().max())
    if factor <= 1.0:
        return None
    for low, high in _LLAMA3_LOW_HIGH:
        for original in _LLAMA3_ORIGINAL_LENGTHS:
            params = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": factor,
                      "low_freq_factor": low, "high_freq_factor": high,
                      "original_max_position_embeddings": original}
            try:
                check_rope_freq_factors(factors, rotary_dim, params)
            except ValueError:
                continue
            return params
    return None


# (rotary_dim, max_position, parameters, device) -> the cos / sin tables, while some layer holds
# them: every layer of a model (and every model of one config) shares one pair instead of
# each layer keeping its own (30 layers x 2 MiB of tables were 0.6x the weights of a 98 MB
# Q4_1 file; a Llama at 131k positions would hold GBs).
_COS_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SIN_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _cos_sin_tables(rotary_dim: int, max_position: int,
                    rope_parameters: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [rows, rotary_dim / 2] of every position (rows = max_position, twice
    that for LongRoPE: short then long factors), on the default device; shared by equal
    requests (read-only tables)."""
    key = (rotary_dim, max_position, repr(sorted(rope_parameters.items())),
           str(torch.get_default_device()))
    cos, sin = _COS_TABLES.get(key), _SIN_TABLES.get(key)
    if cos is not None and sin is not None:
        return cos, sin
    t = torch.arange(max_position, dtype=torch.float32)
    tables = [torch.outer(t, scaled_inv_freq(rotary_dim, rope_parameters))]
    scale = 1.0
    if rope_parameters["rope_type"] == "longrope":
        _, scale = _longrope_factors(rope_parameters)
        tables.append(torch.outer(t, scaled_inv_freq(rotary_dim, rope_parameters, long=True)))
    freqs = torch.cat(tables)                                   # [rows, rotary_dim/2]
    # NOTE(rope): HF multiplies cos and sin by the attention factor (LongRoPE's mscale).
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    _COS_TABLES[key], _SIN_TABLES[key] = cos, sin
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Apply RoPE to query and key.

    Args:
        head_size: size of each head; its first `rotary_dim` = int(head_size *
            partial_rotary_factor) channels are rotated.
        max_position: positions covered by the cache.
        rope_parameters: from `rope_parameters_from_hf`.

    Attributes:
        long_position_offset: for "longrope", added to a position to select the long-factor
            table (= max_position); None for the other types.
        original_max_position: for "longrope", original_max_position_embeddings; else None.
    """

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = int(head_size * rope_parameters.get("partial_rotary_factor", 1.0))
        self.long_position_offset: int | None = None
        self.original_max_position: int | None = None
        if rope_parameters["rope_type"] == "longrope":
            self.long_position_offset = max_position
            self.original_max_position = int(rope_parameters["original_max_position_embeddings"])
        cos, sin = _cos_sin_tables(self.rotary_dim, max_position, rope_parameters)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] int64 (plus `long_position_offset` for LongRoPE's long table);
        query [n, H, D]; key [n, KVH, D] -> rotated (same shapes/dtype)."""
        cos = self.cos_cache[positions][:, None, :].to(query.dtype)   # [n, 1, rotary_dim/2]
        sin = self.sin_cache[positions][:, None, :].to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
