"""ThinkingBudgetLogitsProcessor against the reasoning parsers' rule, token by token."""

from __future__ import annotations

import pytest
import torch

from pagedllm.reasoning import REASONING_PARSERS
from pagedllm.reasoning.budget import ThinkingBudgetLogitsProcessor

START, END, VOCAB = 5, 6, 10


def _forced(processor: ThinkingBudgetLogitsProcessor, output: list[int]) -> bool:
    logits = torch.zeros(VOCAB)
    out = processor(output, logits)
    if out is logits:
        return False
    assert out[END] == 0 and torch.isinf(out).sum() == VOCAB - 1
    return True


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_implicit_start_counts_from_the_first_token(budget: int) -> None:
    p = ThinkingBudgetLogitsProcessor(budget, START, END, implicit_start=True)
    assert [_forced(p, [1] * k) for k in range(budget + 1)] == [False] * budget + [True]
    # A leading start marker is not counted.
    if budget:
        assert not _forced(p, [START] + [1] * (budget - 1))
    assert _forced(p, [START] + [1] * budget)
    # Once the end marker is out, the answer is free.
    assert not _forced(p, [1] * budget + [END]) and not _forced(p, [1] * budget + [END, 2, 2])


def test_explicit_start_reasons_only_after_a_leading_start_marker() -> None:
    p = ThinkingBudgetLogitsProcessor(2, START, END, implicit_start=False)
    assert not _forced(p, [])                     # the first token may or may not be <think>
    assert not _forced(p, [1, 2, 3, 4])           # no leading <think>: no reasoning
    assert not _forced(p, [START, 1]) and _forced(p, [START, 1, 2])
    assert not _forced(p, [START, 1, 2, END])


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_forced_output_splits_with_the_budget(name: str) -> None:
    parser = REASONING_PARSERS[name]
    p = ThinkingBudgetLogitsProcessor(3, START, END, parser.implicit_start)
    output = [START]
    while len(output) < 8:
        output.append(END if _forced(p, output) else 1)
    assert parser.num_reasoning_tokens(output, (START, END)) == 3 + 2   # 3 + both markers


def test_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="thinking_token_budget"):
        ThinkingBudgetLogitsProcessor(-1, START, END, True)
