"""SamplingMetadata: the per-step sampling parameters of the rows being sampled, as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMetadata:
    """Sampling inputs for B rows (one per request sampled this step), all on the logits' device.

    Attributes:
        temperature: [B] float32; 0 = greedy row.
        all_greedy / all_random: shortcuts.
        top_p: [B] float32 or None if no row uses it; top_k: [B] int64 (0 = off) or None;
        min_p: [B] float32 or None.
        seeded_rows, seeds, output_positions: for rows with a seed, the row, its seed and the index
            of the output token being sampled (the seeded noise is a function of both, so a
            request's tokens do not depend on batching, chunking or preemption).
        presence_penalties, frequency_penalties, repetition_penalties: [B] float32 or None.
        prompt_token_ids: [B, P_max] int64 padded with vocab_size (only with penalties).
        output_token_ids: [B, O_max] int64 padded with vocab_size (only with penalties).
        min_tokens_rows / min_tokens_stop_ids: [k] int64 pairs (row, token) to mask to -inf
            because the row has not reached its min_tokens yet.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    seeded_rows: list[int]
    seeds: list[int]
    output_positions: list[int]
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    min_tokens_rows: torch.Tensor | None
    min_tokens_stop_ids: torch.Tensor | None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None
