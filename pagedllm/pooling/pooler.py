"""Pool a flat token batch's hidden states into one vector per request (torch, worker side).

    hidden [num_tokens, H]   r0: rows [0, 5)  r1: rows [5, 8)  r2: rows [8, 9)
    query_start_loc = [0, 5, 8, 9]
    MEAN -> mean of each request's rows, CLS -> row query_start_loc[r],
    LAST -> row query_start_loc[r + 1] - 1

Every request's whole prompt must be in the batch (the pooling runner never chunks prompts).
Pooling is done in float32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor,
         pooling_types: list[str], normalize: list[bool]) -> torch.Tensor:
    """Pool each request's rows.

    Args:
        hidden: [num_tokens, H] final hidden states of the flat batch.
        query_start_loc: [num_reqs + 1] int (same device), cumulative prompt lengths.
        pooling_types: per request "MEAN", "CLS" or "LAST".
        normalize: per request, whether to L2-normalise.

    Returns:
        [num_reqs, H] float32.

    Raises:
        ValueError: for an unknown pooling type or mismatched list lengths.
    """
    num_reqs = query_start_loc.shape[0] - 1
    if len(pooling_types) != num_reqs or len(normalize) != num_reqs:
        raise ValueError(f"{len(pooling_types)} pooling types / {len(normalize)} normalize flags "
                         f"for {num_reqs} requests")
    hidden = hidden.float()
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    lens = ends - starts
    # Segment sums: req_indices[t] is the request of token t.
    req_indices = torch.repeat_interleave(torch.arange(num_reqs, device=hidden.device), lens)
    sums = torch.zeros(num_reqs, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    sums.index_add_(0, req_indices, hidden)
    candidates = {"MEAN": sums / lens[:, None].to(hidden.dtype), "CLS": hidden[starts],
                  "LAST": hidden[ends - 1]}
    out = torch.empty_like(sums)
    for kind in set(pooling_types):
        if kind not in candidates:
            raise ValueError(f"unknown pooling type {kind!r}; use one of {sorted(candidates)}")
        rows = torch.tensor([i for i, k in enumerate(pooling_types) if k == kind],
                            device=hidden.device)
        out[rows] = candidates[kind][rows]
    norm_rows = torch.tensor([i for i, n in enumerate(normalize) if n], dtype=torch.long,
                             device=hidden.device)
    if len(norm_rows):
        out[norm_rows] = F.normalize(out[norm_rows], p=2, dim=-1)
    return out
