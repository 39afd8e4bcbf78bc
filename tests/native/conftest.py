"""Fixtures shared by the native-path tests."""

from __future__ import annotations

import pytest

from pagedllm.native.decode_loop import HybridGreedyDecodeLoop
from tests.fixtures.runner_steps import count_loop_tokens


@pytest.fixture
def loop_tokens(monkeypatch):
    """Counts the tokens decoded by `HybridGreedyDecodeLoop.run` (steps x requests):
    `loop_tokens["tokens"]`."""
    return count_loop_tokens(monkeypatch, HybridGreedyDecodeLoop)
