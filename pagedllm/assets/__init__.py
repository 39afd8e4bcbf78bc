"""Checkpoints shipped with the package (trained by scripts/train_demo_models.py, issue #3)."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"
ADAPTERS_DIR = Path(__file__).parent / "adapters"
DEFAULT_MODEL_NAME = "shakespeare-10m"
DEFAULT_DRAFT_MODEL_NAME = "shakespeare-draft-2m"


def _shipped(folder: Path, name: str, marker: str, kind: str) -> str:
    """`folder / name` when it holds `marker`; else FileNotFoundError naming the ones it has."""
    path = folder / name
    if not (path / marker).is_file():
        have = sorted(p.name for p in folder.iterdir() if (p / marker).is_file()) \
            if folder.is_dir() else []
        raise FileNotFoundError(f"no shipped {kind} {name!r} in {folder}; available: {have}")
    return str(path)


def model_path(name: str) -> str:
    """Folder of a shipped model.

    Raises:
        FileNotFoundError: if the package holds no such model, naming the ones it has.
    """
    return _shipped(MODELS_DIR, name, "config.json", "model")


def adapter_path(name: str) -> str:
    """Folder of a shipped LoRA adapter (PEFT format; trained by scripts/train_lora_adapter.py).

    Raises:
        FileNotFoundError: if the package holds no such adapter, naming the ones it has.
    """
    return _shipped(ADAPTERS_DIR, name, "adapter_config.json", "adapter")


def default_model_path() -> str:
    """The default model: the shipped Shakespeare target model."""
    return model_path(DEFAULT_MODEL_NAME)
