"""Sampler: logits [B, V] -> one token id per row (and its logprobs when asked).

Pipeline (vLLM order): allowed tokens -> banned tokens (bad words, min_tokens) -> logit bias ->
user logits processors -> penalties -> greedy argmax | temperature -> min-p -> top-k/top-p ->
random choice. The random choice is the exponential race: argmax(p / q) with
q ~ Exp(1) i.i.d. draws a token with probability p (equivalent to Gumbel-max), batched over rows.
Seeded rows draw their q from a generator seeded by (seed, output position), so a request's
tokens never depend on what else is in the batch or on how its prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops.argmax import row_argmax
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
    """sampled_token_ids [B] int64; logprobs for the sampled tokens when any row asked;
    failed_rows: {row: message} of rows whose logits processor failed (their token is
    meaningless and must be discarded)."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None
    failed_rows: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Distributions:
    """raw: [B, V] model logits; processed: [B, V] logits the token is drawn from (after every
    edit and, for random rows, temperature/min-p/top-k/top-p); greedy: [B] argmax of the edited
    logits (None if all rows are random); probs: [B, V] softmax(processed) (None if all greedy);
    failed_rows: {row: message} of rows whose logits processor failed."""

    raw: torch.Tensor
    processed: torch.Tensor
    greedy: torch.Tensor | None
    probs: torch.Tensor | None
    failed_rows: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Sample one token per row. `generator` is the engine's RNG for unseeded rows."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] float32 (not modified) -> SamplerOutput."""
        dist = self.distributions(logits, metadata)
        sampled = dist.greedy
        if dist.probs is not None:
            random = self.race(dist.probs, metadata)
            sampled = random if dist.greedy is None else torch.where(
                metadata.temperature > 0, random, dist.greedy)
        return SamplerOutput(sampled, self.logprobs(dist, sampled, metadata), dist.failed_rows)

    def distributions(self, logits: torch.Tensor, md: SamplingMetadata) -> Distributions:
        raw = logits.float()
        logits, failed = self._process(raw, md)
        greedy = None if md.all_random else row_argmax(logits)
        if md.all_greedy:
            return Distributions(raw, logits, greedy, None, failed)
        temperature = md.temperature
        logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        return Distributions(raw, logits, greedy, logits.softmax(dim=-1), failed)

    def noise(self, like: torch.Tensor, md: SamplingMetadata, stream: int = 0,
              exponential: bool = True) -> torch.Tensor:
        """i.i.d. Exp(1) (or U[0,1)) noise shaped like `like` ([B, V] or [B]); seeded rows draw
        from (seed, output position, stream) so they are reproducible alone or batched."""
        out = torch.empty_like(like, dtype=torch.float32)
        draw = (lambda t, g: t.exponential_(generator=g)) if exponential else (
            lambda t, g: t.uniform_(generator=g))
        draw(out, self.generator)
        for row, seed, pos in zip(md.seeded_rows, md.seeds, md.output_positions):
            self._seeded_generator.manual_seed(_mix_seed(seed + stream * 0x5851F42D, pos))
            draw(out[row], self._seeded_generator)
        return out

    def race(self, probs: torch.Tensor, md: SamplingMetadata, stream: int = 0) -> torch.Tensor:
        """Draw one token per row of probs [B, V] (exponential race)."""
        q = self.noise(probs, md, stream).clamp_min_(1e-20)
        return row_argmax(probs.div(q))

    @staticmethod
    def _process(logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[torch.Tensor, dict[int, str]]:
        """Request-specific edits before temperature (each returns a new tensor); also returns
        the rows whose logits processor failed."""
        failed: dict[int, str] = {}
        if md.allowed_token_mask is not None:
            logits = apply_allowed_token_mask(logits, md.allowed_token_mask)
        if md.banned_rows is not None:
            logits = apply_banned_tokens(logits, md.banned_rows, md.banned_token_ids)
        if md.logit_bias_rows is not None:
            logits = apply_logit_bias(logits, md.logit_bias_rows, md.logit_bias_token_ids,
                                      md.logit_bias_values)
        if md.logits_processors:
            logits, failed = apply_logits_processors(logits, md.logits_processors)
        if not md.no_penalties:
            logits = apply_penalties(logits, md.prompt_token_ids, md.output_token_ids,
                                     md.presence_penalties, md.frequency_penalties,
                                     md.repetition_penalties)
        return logits, failed

    @staticmethod
    def logprobs(dist: Distributions, tokens: torch.Tensor,
                 md: SamplingMetadata) -> LogprobsTensors | None:
        """Logprobs of `tokens` [B] per the metadata's logprobs_mode (None if no row asked)."""
        if md.max_num_logprobs is None:
            return None
        source = dist.raw if md.logprobs_mode == "raw_logprobs" else dist.processed
        return compute_logprobs(source, tokens, md.max_num_logprobs)
