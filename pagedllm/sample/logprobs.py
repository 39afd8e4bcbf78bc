"""Logprobs of chosen tokens: their value, their rank in the vocabulary, and the top-k.

Which distribution they come from is the engine's `logprobs_mode` (vLLM's names):
- "raw_logprobs": log_softmax of the model's logits, before any processing (default);
- "processed_logprobs": log_softmax of the logits the token was actually sampled from, after
  allowed-tokens/bad-words/min-tokens masks, logit bias, logits processors, penalties,
  temperature (random rows only), min-p and top-k/top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class LogprobsTensors:
    """token_ids [n, k+1] int64 (column 0 = the chosen token), logprobs [n, k+1] float32,
    ranks [n] int64 (1 = most likely)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: int) -> LogprobsTensors:
    """logits [n, V] float32, chosen token_ids [n] int64, top-k size -> LogprobsTensors."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])                       # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    num_logprobs = min(num_logprobs, logprobs.shape[-1])
    if num_logprobs > 0:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        return LogprobsTensors(torch.cat([token_ids[:, None], top_ids], 1),
                               torch.cat([chosen, top_lp], 1), ranks)
    return LogprobsTensors(token_ids[:, None], chosen, ranks)
