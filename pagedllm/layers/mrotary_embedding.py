"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL; Wang et al. 2024, "Qwen2-VL").

Each token has three positions (temporal, height, width). The rotary frequencies of a head are
split into sections (`mrope_section`, summing to rotary_dim / 2): the first section rotates by
the temporal position, the second by the height, the third by the width.

    inv_freq:     [ f_0 ... f_{s0-1} | f_{s0} ... f_{s0+s1-1} | ... f_{rotary_dim/2-1} ]
    angle rows:   [   t * f          |        h * f           |         w * f        ]

Qwen3-VL interleaves the axes instead (`interleaved`): frequency j takes the height row for
j = 1, 4, 7, ... (s1 of them), the width row for j = 2, 5, 8, ... (s2), and the temporal row
for the others (HF's `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`).

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
        interleaved: Qwen3-VL's interleaved axes, else Qwen2-VL's contiguous sections.

    Raises:
        ValueError: a section that does not sum to rotary_dim / 2, or a scaled RoPE type.
    """

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any],
                 mrope_section: list[int], interleaved: bool = False) -> None:
        super().__init__(head_size, max_position, rope_parameters)
        if rope_parameters["rope_type"] != "default":
            raise ValueError(f"M-RoPE with rope type {rope_parameters['rope_type']!r} is not "
                             "supported")
        if len(mrope_section) != 3 or sum(mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must have 3 entries summing "
                             f"to rotary_dim / 2 = {self.rotary_dim // 2}")
        self.mrope_section = [int(s) for s in mrope_section]
        half = self.rotary_dim // 2
        axis = torch.zeros(half, dtype=torch.int64)
        if interleaved:
            axis[1:3 * self.mrope_section[1]:3] = 1
            axis[2:3 * self.mrope_section[2]:3] = 2
        else:
            t, h, _ = self.mrope_section
            axis[t:t + h] = 1
            axis[t + h:] = 2
        # [rotary_dim / 2]: which position row (0 t, 1 h, 2 w) each frequency rotates by.
        self.register_buffer("axis_of_freq", axis, persistent=False)

    def _select(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[3, n] positions -> [n, rotary_dim / 2]: frequency j from row axis_of_freq[j]."""
        rows = table[positions]                                   # [3, n, rotary_dim/2]
        index = self.axis_of_freq.view(1, 1, -1).expand(1, rows.shape[1], -1)
        return rows.gather(0, index)[0]

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] or [3, n] int64; query [n, H, D]; key [n, KVH, D] -> rotated."""
        if positions.ndim == 1:
            return super().forward(positions, query, key)
        cos = self._select(self.cos_cache, positions)[:, None, :].to(query.dtype)
        sin = self._select(self.sin_cache, positions)[:, None, :].to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
