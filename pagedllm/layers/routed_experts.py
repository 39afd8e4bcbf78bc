"""The device buffer MoE layers write their router's choices into during a forward.

    buffer [max_num_tokens, num_moe_layers, top_k] int16
    row t: token t of the flat batch;  column l: the model's l-th MoE layer (in layer order)

One buffer per model, bound to its `FusedMoE` layers by worker/routed_experts.py; each layer's
`forward_routed` copies its logical top-k ids (before any redundant-expert mapping, so what an
HF router would pick) into its column. The copy is a device-side slice write into a buffer
allocated once, so it works inside captured CUDA graphs. Nothing here reads the buffer.
"""

from __future__ import annotations

import torch


class RoutedExpertsCapture:
    """Where a model's MoE layers record routed expert ids.

    Args:
        max_num_tokens: most tokens of one forward.
        num_moe_layers, top_k: the buffer's other dimensions.
        device: where the model runs.
    """

    def __init__(self, max_num_tokens: int, num_moe_layers: int, top_k: int,
                 device: torch.device) -> None:
        self.buffer = torch.full((max_num_tokens, num_moe_layers, top_k), -1,
                                 dtype=torch.int16, device=device)

    def record(self, moe_layer_index: int, topk_ids: torch.Tensor) -> None:
        """Store `topk_ids` [n, top_k] (int64 logical expert ids) as layer
        `moe_layer_index`'s routing of the forward's first n tokens."""
        self.buffer[:topk_ids.shape[0], moe_layer_index].copy_(topk_ids)
