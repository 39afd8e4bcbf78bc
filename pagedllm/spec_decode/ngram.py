"""N-gram (prompt lookup) proposer: if the last n tokens occurred before in the request, propose
the k tokens that followed that earlier occurrence (Saxena 2023, "prompt lookup decoding"; vLLM's
ngram method). Longer n-grams are tried first; the most recent earlier occurrence wins."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Args: num_speculative_tokens (k), prompt_lookup_min/max (n-gram sizes)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, tokens: np.ndarray, max_drafts: int) -> list[int]:
        """tokens [L] int: the request's tokens so far -> up to min(k, max_drafts) drafts."""
        k = min(self.k, max_drafts)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Windows that start before the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                drafts = tokens[start:start + k]
                if len(drafts):
                    return drafts.tolist()
        return []
