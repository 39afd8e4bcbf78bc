"""Speculative decoding counters of the scheduler (`SchedulerStats.spec_decoding_stats`, the
`pagedllm:spec_decode_*` metrics): plain Python, filled by `Scheduler.update_from_output`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters since start (vLLM's names): steps of a request with drafts,
    draft tokens verified, draft tokens accepted, and per draft position i (0 = the first draft)
    how many drafts had their position i accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified drafts: `num_accepted_tokens` of `num_draft_tokens` (a
        prefix of them: rejection stops at the first rejected draft)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    def copy(self) -> SpecDecodingStats:
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def minus(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts since `earlier` (a copy taken before); all of them if the counters
        were reset since (a restarted engine)."""
        if self.num_drafts < earlier.num_drafts:
            return self.copy()
        per_pos = list(self.num_accepted_tokens_per_pos)
        for i, n in enumerate(earlier.num_accepted_tokens_per_pos):
            per_pos[i] -= n
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts,
                                 self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per draft position, the fraction of drafts accepted there."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per drafted step (accepted drafts + the target's own token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
