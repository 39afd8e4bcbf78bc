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
        banned_rows / banned_token_ids: [k] int64 pairs (row, token) masked to -inf: stop tokens
            of rows below min_tokens, and the last token of bad words about to complete.
        allowed_token_mask: [B, V] bool or None (allowed_token_ids).
        logit_bias_rows / logit_bias_token_ids / logit_bias_values: [k] pairs and biases, or None.
        logits_processors: (row, [callable], output token ids) for rows with user processors.
        max_num_logprobs: largest `logprobs` among the rows (None = no row wants logprobs).
        logprobs_mode: "raw_logprobs" or "processed_logprobs" (see sample/logprobs.py).
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
    banned_rows: torch.Tensor | None
    banned_token_ids: torch.Tensor | None
    allowed_token_mask: torch.Tensor | None = None
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_token_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    logits_processors: list = ()
    max_num_logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None
