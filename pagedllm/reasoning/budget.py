"""A cap on reasoning tokens: `thinking_token_budget` (vLLM's request field).

The reasoning is read on the output's token ids by the parser's own rule (parsers.py): with an
implicit start (deepseek_r1) the output reasons from its first token, a leading start marker
aside; otherwise (qwen3) only an output whose first token is the start marker reasons. Once
`budget` reasoning tokens (markers not counted) have been generated without the end marker, the
processor leaves the end marker as the only token the request can sample, so the answer starts
at once. The processor is a plain `logits_processors` callable, so the engine needs no notion of
reasoning: it runs in the worker on the request's output ids alone, and pickles across processes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudgetLogitsProcessor:
    """`(output_token_ids, logits [vocab] float32) -> logits` forcing the end marker once the
    reasoning holds `budget` tokens.

    Args:
        budget: most reasoning tokens (>= 0), markers not counted.
        start_token_id, end_token_id: the reasoning markers' ids
            (`ReasoningParser.marker_token_ids`).
        implicit_start: the parser's rule (`ReasoningParser.implicit_start`).

    Raises:
        ValueError: a negative budget.
    """

    budget: int
    start_token_id: int
    end_token_id: int
    implicit_start: bool

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {self.budget}")

    def num_reasoning_tokens(self, output_token_ids: list[int]) -> int | None:
        """Reasoning tokens so far, or None when the output is not (or no longer) reasoning."""
        offset = 1 if output_token_ids and output_token_ids[0] == self.start_token_id else 0
        if not offset and not self.implicit_start:
            return None     # qwen3 without a leading start marker: no reasoning (or not yet)
        # NOTE(budget): the end marker is forced at reasoning token `budget`, so an output longer
        # than that (plus the markers) has closed its reasoning: O(1) for the answer's tokens.
        if len(output_token_ids) > self.budget + 1 + offset:
            return None
        if self.end_token_id in output_token_ids:
            return None
        return len(output_token_ids) - offset

    def __call__(self, output_token_ids: list[int], logits):
        count = self.num_reasoning_tokens(output_token_ids)
        if count is None or count < self.budget:
            return logits
        forced = logits.new_full(logits.shape, float("-inf"))
        forced[self.end_token_id] = 0.0
        return forced
