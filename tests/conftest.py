"""Session-wide test fixtures: tiny tokenizers and tiny random-weight checkpoints, plus markers.

Tokenizers and checkpoints are built offline under pytest's session temp dir; checkpoints are built
lazily on first access, so a test run pays only for the variants it uses. Tests marked `cuda` are
skipped when torch sees no CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.checkpoints import TINY_VARIANTS, build_tiny_variant
from tests.fixtures.tokenizers import build_byte_level_tokenizer, build_sentencepiece_like_tokenizer

_MARKERS = {
    "slow": "long-running tests, excluded from the default run (-m 'not slow')",
    "cuda": "needs a CUDA device; skipped on CPU",
}


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated so the markers exist when pytest runs without it.
    for name, description in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def env_options_of_this_test() -> None:
    """`current_platform.options` read from the environment this test starts with: an engine
    start reads them again (tests that `setenv` and then build an `LLM` need nothing more), but
    one that calls layers or kernels directly after a `setenv` calls
    `current_platform.configure_options()` itself; an earlier test's engine leaves nothing."""
    from pagedllm.platforms import current_platform

    current_platform.configure_options()


class TinyCheckpoints:
    """Variant name (a key of `TINY_VARIANTS`) -> checkpoint folder, built on first access.

    Raises KeyError for an unknown name. Folders are shared by the whole session: tests must not
    write into them.
    """

    def __init__(self, root: Path, tokenizer_dirs: dict[str, Path]):
        self._root = root
        self._tokenizer_dirs = tokenizer_dirs
        self._paths: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in TINY_VARIANTS:
            raise KeyError(f"unknown tiny checkpoint {name!r}; known: {sorted(TINY_VARIANTS)}")
        if name not in self._paths:
            self._paths[name] = build_tiny_variant(name, self._root / name, self._tokenizer_dirs)
        return self._paths[name]

    def __contains__(self, name: object) -> bool:
        return name in TINY_VARIANTS

    def __iter__(self):
        return iter(TINY_VARIANTS)

    def __len__(self) -> int:
        return len(TINY_VARIANTS)

    def keys(self) -> list[str]:
        return list(TINY_VARIANTS)

    def items(self) -> list[tuple[str, Path]]:
        return [(name, self[name]) for name in TINY_VARIANTS]


@pytest.fixture(scope="session")
def byte_level_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the byte-level BPE tokenizer (`<s>`, `</s>`, `<pad>`, chat template)."""
    return build_byte_level_tokenizer(tmp_path_factory.mktemp("byte_level_tokenizer"))


@pytest.fixture(scope="session")
def sentencepiece_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the Llama-2 style Metaspace BPE tokenizer with byte fallback."""
    return build_sentencepiece_like_tokenizer(tmp_path_factory.mktemp("sentencepiece_tokenizer"))


@pytest.fixture(scope="session")
def tiny_checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
    byte_level_tokenizer_dir: Path,
    sentencepiece_tokenizer_dir: Path,
) -> TinyCheckpoints:
    """Lazily built tiny checkpoints: `tiny_checkpoints["qwen3"]` is a folder for `from_pretrained`."""
    tokenizer_dirs = {"byte_level": byte_level_tokenizer_dir, "sentencepiece": sentencepiece_tokenizer_dir}
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny_checkpoints"), tokenizer_dirs)


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: TinyCheckpoints) -> Path:
    """The "llama" variant: LlamaForCausalLM, GQA (4 heads, 2 KV heads), byte-level tokenizer."""
    return tiny_checkpoints["llama"]
