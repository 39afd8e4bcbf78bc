"""Repetition, presence and frequency penalties with vLLM semantics.

- repetition (Keskar et al. 2019, CTRL): for tokens seen in the prompt or the output, positive
  logits are divided by the penalty and negative ones multiplied by it;
- presence / frequency (OpenAI): over output tokens, logit -= presence * [count > 0]
  + frequency * count.
"""

from __future__ import annotations

import torch


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, vocab_size] counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor,
                    output_token_ids: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 (modified in place and returned); penalties [B] float32."""
    vocab_size = logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab_size)
    seen = (_token_counts(prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
    rep = repetition[:, None].expand_as(logits)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * (output_counts > 0)
    return logits
