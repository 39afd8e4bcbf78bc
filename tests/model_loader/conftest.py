"""Fixtures of the model-loader tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def float_gguf_activations():
    """Exact float32 activations in the GGUF layers built in the module: transformers (the
    oracle) computes on the dequantized weights, and the default 8-bit activations would move
    its logits."""
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")
    yield
    patch.undo()
