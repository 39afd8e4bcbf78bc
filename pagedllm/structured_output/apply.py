"""Worker side: apply a grammar bitmask to logits (disallowed tokens -> -inf).

    bitmask int32 [rows, ceil(V / 32)]: token t is allowed iff bit (t % 32) of word t // 32 is 1.
"""

from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          logits_rows: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32; bitmask [R, W] int32; logits_rows [R] int64 (the logits row each
    bitmask row applies to). Returns new logits."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    logits = logits.clone()
    logits[logits_rows] = logits[logits_rows].masked_fill(~allowed, float("-inf"))
    return logits
