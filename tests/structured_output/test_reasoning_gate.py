"""Structured output waits for the reasoning to end (StructuredOutputManager with a reasoning
parser), token by token, drafts included."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import transformers

from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import StructuredOutputsParams
from tests.fixtures.tokenizers import build_tool_chat_tokenizer

SCHEMA = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory, byte_level_tokenizer_dir: Path):
    path = build_tool_chat_tokenizer(tmp_path_factory.mktemp("think_tokenizer"),
                                     byte_level_tokenizer_dir)
    return transformers.AutoTokenizer.from_pretrained(path)


def _manager(tokenizer, parser: str) -> StructuredOutputManager:
    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer), parser)
    manager.add_request("r", SCHEMA)
    deadline = time.monotonic() + 30
    while not manager.is_ready("r"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return manager


def _allowed(bitmask: np.ndarray, row: int, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_deepseek_r1_grammar_starts_after_end_of_thinking(tokenizer) -> None:
    vocab = len(tokenizer)
    end = tokenizer.convert_tokens_to_ids("</think>")
    brace = tokenizer.convert_tokens_to_ids("{")
    word = tokenizer.encode("hello", add_special_tokens=False)
    manager = _manager(tokenizer, "deepseek_r1")
    assert _allowed(manager.grammar_bitmask([("r", [])]), 0, vocab) == set(range(vocab))
    assert manager.accept_tokens("r", word) is False
    # Drafts stop at the end marker; the row after it is the grammar's first.
    assert manager.validate_tokens("r", [word[0], end, brace, brace]) == [word[0], end]
    rows = manager.grammar_bitmask([("r", [word[0], end])])
    assert _allowed(rows, 0, vocab) == _allowed(rows, 1, vocab) == set(range(vocab))
    grammar_first = _allowed(rows, 2, vocab)
    assert brace in grammar_first and end not in grammar_first and len(grammar_first) < vocab
    # Accepting "</think> {" moves the matcher past "{" only.
    manager.accept_tokens("r", [end, brace])
    after_brace = _allowed(manager.grammar_bitmask([("r", [])]), 0, vocab)
    assert brace not in after_brace and after_brace != grammar_first


def test_qwen3_first_token_may_open_thinking_or_answer(tokenizer) -> None:
    vocab = len(tokenizer)
    start = tokenizer.convert_tokens_to_ids("<think>")
    brace = tokenizer.convert_tokens_to_ids("{")
    thinking = _manager(tokenizer, "qwen3")
    first = _allowed(thinking.grammar_bitmask([("r", [])]), 0, vocab)
    assert start in first and brace in first and len(first) < vocab
    assert thinking.validate_tokens("r", [start]) == []
    thinking.accept_tokens("r", [start])
    assert _allowed(thinking.grammar_bitmask([("r", [])]), 0, vocab) == set(range(vocab))

    answering = _manager(tokenizer, "qwen3")
    answering.accept_tokens("r", [brace])       # thinking off: the grammar took "{"
    assert brace not in _allowed(answering.grammar_bitmask([("r", [])]), 0, vocab)


def test_parser_whose_markers_are_not_tokens_fails_at_start(byte_level_tokenizer_dir) -> None:
    plain = transformers.AutoTokenizer.from_pretrained(byte_level_tokenizer_dir)
    with pytest.raises(ValueError, match="needs '<think>' as one token"):
        StructuredOutputManager(lambda: plain, len(plain), "deepseek_r1")
