"""SpecDecodeMetadata: where each sampled request's draft and bonus logits sit in a step.

A request with k draft tokens is scheduled as [last token, d1, ..., dk]; the target's logits at
those k+1 positions verify d1..dk (target positions) and give the bonus token (last position):

    flat tokens of row b:   t  d1  d2  d3            (k = 3)
    logits rows:            0   1   2   3            0..2 verify d1..d3, row 3 = bonus
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """For the B rows sampled this step (in logits order).

    Attributes:
        draft_token_ids: [total_drafts] int64 numpy, drafts of all rows in order.
        num_draft_tokens: [B] int32 numpy (0 for rows without drafts).
        cu_num_draft_tokens: [B] int32 numpy, cumulative draft counts.
        logits_indices: [B + total_drafts] int64, flat token index of every logits row.
        cu_num_logits: [B + 1] int64 numpy, logits rows of row b are [cu[b], cu[b+1]).
    """

    draft_token_ids: np.ndarray
    num_draft_tokens: np.ndarray
    cu_num_draft_tokens: np.ndarray
    logits_indices: np.ndarray
    cu_num_logits: np.ndarray

    @property
    def num_logits(self) -> int:
        return int(self.cu_num_logits[-1])

    def draft_tokens_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.draft_token_ids).to(device)


def build_spec_decode_metadata(draft_token_ids: list[list[int]],
                               last_token_index: np.ndarray) -> SpecDecodeMetadata:
    """draft_token_ids: per sampled row its drafts (possibly empty); last_token_index: [B] flat
    index of each row's last scheduled token."""
    num_draft = np.array([len(d) for d in draft_token_ids], dtype=np.int32)
    num_logits = num_draft + 1
    cu_num_logits = np.zeros(len(num_draft) + 1, dtype=np.int64)
    np.cumsum(num_logits, out=cu_num_logits[1:])
    # Row b's logits come from flat tokens [last - k_b, last].
    row_of_logit = np.repeat(np.arange(len(num_draft)), num_logits)
    offset_in_row = np.arange(cu_num_logits[-1]) - cu_num_logits[row_of_logit]
    logits_indices = (last_token_index[row_of_logit] - num_draft[row_of_logit]
                      + offset_in_row).astype(np.int64)
    flat_drafts = np.array([t for d in draft_token_ids for t in d], dtype=np.int64)
    return SpecDecodeMetadata(draft_token_ids=flat_drafts, num_draft_tokens=num_draft,
                              cu_num_draft_tokens=np.cumsum(num_draft, dtype=np.int32),
                              logits_indices=logits_indices, cu_num_logits=cu_num_logits)
