"""Fixtures shared by the native-path tests."""

from __future__ import annotations

import pytest

from pagedllm.native.decode_loop import HybridGreedyDecodeLoop


@pytest.fixture
def loop_tokens(monkeypatch):
    """Counts the tokens decoded by `HybridGreedyDecodeLoop.run` (steps x requests):
    `loop_tokens["tokens"]`."""
    calls = {"tokens": 0}
    run = HybridGreedyDecodeLoop.run

    def counting(self, *args, **kwargs):
        tokens = run(self, *args, **kwargs)
        calls["tokens"] += tokens.size
        return tokens

    monkeypatch.setattr(HybridGreedyDecodeLoop, "run", counting)
    return calls
