"""Fixtures shared by the server tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.tokenizers import build_tool_chat_tokenizer


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory, byte_level_tokenizer_dir: Path) -> Path:
    """A tiny Llama whose tokenizer has a tool-calling chat template (tool-call tests)."""
    tokenizer_dir = build_tool_chat_tokenizer(tmp_path_factory.mktemp("tool_tokenizer"),
                                              byte_level_tokenizer_dir)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tool_llama"), "LlamaForCausalLM",
                                tokenizer_dir, num_key_value_heads=2)
