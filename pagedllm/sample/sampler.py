"""Sampler: logits [B, V] -> one token id per row.

Pipeline (vLLM order): min_tokens masking -> penalties -> greedy argmax | temperature -> min-p ->
top-k/top-p -> random choice. The random choice is the exponential race: argmax(p / q) with
q ~ Exp(1) i.i.d. draws a token with probability p (equivalent to Gumbel-max), batched over rows.
Seeded rows draw their q from a generator seeded by (seed, output position), so a request's
tokens never depend on what else is in the batch or on how its prompt was chunked.
"""

from __future__ import annotations

import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops.penalties import apply_penalties
from pagedllm.sample.ops.topk_topp import apply_min_p, apply_top_k_top_p

_MASK64 = (1 << 63) - 1


def _mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed for (request seed, output position) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


class Sampler:
    """Sample one token per row. `generator` is the engine's RNG for unseeded rows."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [B, V] float32 -> sampled token ids [B] int64."""
        logits = logits.float()
        if metadata.min_tokens_rows is not None:
            logits = logits.index_put((metadata.min_tokens_rows, metadata.min_tokens_stop_ids),
                                      torch.tensor(float("-inf"), device=logits.device))
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata.prompt_token_ids, metadata.output_token_ids,
                                     metadata.presence_penalties, metadata.frequency_penalties,
                                     metadata.repetition_penalties)
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
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
        return random if greedy is None else torch.where(temperature > 0, random, greedy)
