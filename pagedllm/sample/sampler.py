"""Sampler: logits [B, V] -> one token id per row (and its logprobs when asked).

Pipeline (vLLM order): allowed tokens -> banned tokens (bad words, min_tokens) -> logit bias ->
user logits processors -> penalties -> greedy argmax | temperature -> min-p -> top-k/top-p ->
random choice. The random choice is the exponential race: argmax(p / q) with
q ~ Exp(1) i.i.d. draws a token with probability p (equivalent to Gumbel-max), batched over rows.
Seeded rows draw their q from a generator seeded by (seed, output position), so a request's
tokens never depend on what else is in the batch or on how its prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops.bias import (apply_allowed_token_mask, apply_banned_tokens,
                                      apply_logit_bias, apply_logits_processors)
from pagedllm.sample.ops.penalties import apply_penalties
from pagedllm.sample.ops.topk_topp import apply_min_p, apply_top_k_top_p

_MASK64 = (1 << 63) - 1


def _mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed for (request seed, output position) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


@dataclass(frozen=True)
class SamplerOutput:
    """sampled_token_ids [B] int64; logprobs for the sampled tokens when any row asked."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


class Sampler:
    """Sample one token per row. `generator` is the engine's RNG for unseeded rows."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] float32 (not modified) -> SamplerOutput."""
        raw = logits.float()
        logits = self._process(raw, metadata)
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return self._output(greedy, raw, logits, metadata)
        temperature = metadata.temperature
        logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed, pos in zip(metadata.seeded_rows, metadata.seeds,
                                  metadata.output_positions):
            self._seeded_generator.manual_seed(_mix_seed(seed, pos))
            q[row].exponential_(generator=self._seeded_generator)
        random = probs.div(q.clamp_min_(1e-20)).argmax(dim=-1)
        sampled = random if greedy is None else torch.where(temperature > 0, random, greedy)
        return self._output(sampled, raw, logits, metadata)

    @staticmethod
    def _process(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Request-specific edits before temperature (each returns a new tensor)."""
        if md.allowed_token_mask is not None:
            logits = apply_allowed_token_mask(logits, md.allowed_token_mask)
        if md.banned_rows is not None:
            logits = apply_banned_tokens(logits, md.banned_rows, md.banned_token_ids)
        if md.logit_bias_rows is not None:
            logits = apply_logit_bias(logits, md.logit_bias_rows, md.logit_bias_token_ids,
                                      md.logit_bias_values)
        if md.logits_processors:
            logits = apply_logits_processors(logits, md.logits_processors)
        if not md.no_penalties:
            logits = apply_penalties(logits, md.prompt_token_ids, md.output_token_ids,
                                     md.presence_penalties, md.frequency_penalties,
                                     md.repetition_penalties)
        return logits

    @staticmethod
    def _output(sampled: torch.Tensor, raw: torch.Tensor, processed: torch.Tensor,
                md: SamplingMetadata) -> SamplerOutput:
        if md.max_num_logprobs is None:
            return SamplerOutput(sampled, None)
        source = raw if md.logprobs_mode == "raw_logprobs" else processed
        return SamplerOutput(sampled, compute_logprobs(source, sampled, md.max_num_logprobs))
