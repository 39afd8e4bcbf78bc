"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL; Wang et al. 2024, "Qwen2-VL").

Each token has three positions (temporal, height, width). The rotary frequencies of a head are
split into sections (`mrope_section`, summing to rotary_dim / 2): the first section rotates by
the temporal position, the second by the height, the third by the width.

    inv_freq:     [ f_0 ... f_{s0-1} | f_{s0} ... f_{s0+s1-1} | ... f_{rotary_dim/2-1} ]
    angle rows:   [   t * f          |        h * f           |         w * f        ]

Text tokens carry the same value in all three rows, so for them M-RoPE is plain RoPE: a step
whose tokens all have equal rows passes 1-D positions [n] (and takes every plain-RoPE path,
the native fused decoder included); a step with image tokens passes [3, n].
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.rotary_embedding import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over 1-D positions [n] or M-RoPE over positions [3, n] (t, h, w) int64.

    Args:
        head_size, max_position, rope_parameters: as `RotaryEmbedding` ("default" type only).
        mrope_section: rotary frequencies per axis, e.g. [16, 24, 24]; sums to rotary_dim / 2.

    Raises:
        ValueError: a section that does not sum to rotary_dim / 2, or a scaled RoPE type.
    """

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any],
                 mrope_section: list[int]) -> None:
        super().__init__(head_size, max_position, rope_parameters)
        if rope_parameters["rope_type"] != "default":
            raise ValueError(f"M-RoPE with rope type {rope_parameters['rope_type']!r} is not "
                             "supported")
        if len(mrope_section) != 3 or sum(mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must have 3 entries summing "
                             f"to rotary_dim / 2 = {self.rotary_dim // 2}")
        self.mrope_section = [int(s) for s in mrope_section]

    def _select(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[3, n] positions -> [n, rotary_dim / 2]: section i of the frequencies from row i."""
        rows = table[positions]                                   # [3, n, rotary_dim/2]
        return torch.cat([rows[i, :, part] for i, part in enumerate(self._sections())], dim=-1)

    def _sections(self) -> list[slice]:
        ends = torch.tensor(self.mrope_section).cumsum(0).tolist()
        return [slice(e - s, e) for s, e in zip(self.mrope_section, ends)]

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] or [3, n] int64; query [n, H, D]; key [n, KVH, D] -> rotated."""
        if positions.ndim == 1:
            return super().forward(positions, query, key)
        cos = self._select(self.cos_cache, positions)[:, None, :].to(query.dtype)
        sin = self._select(self.sin_cache, positions)[:, None, :].to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
