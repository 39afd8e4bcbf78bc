"""Checkpoints shipped with the package (trained by scripts/train_demo_models.py, issue #3)."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"
ADAPTERS_DIR = Path(__file__).parent / "adapters"
DEFAULT_MODEL_NAME = "shakespeare-10m"
DEFAULT_DRAFT_MODEL_NAME = "shakespeare-draft-2m"


def model_path(name: str) -> str:
    """Folder of a shipped model.

    Raises:
        FileNotFoundError: if the package holds no such model, naming the ones it has.
    """
    path = MODELS_DIR / name
    if not (path / "config.json").is_file():
        have = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file()) \
            if MODELS_DIR.is_dir() else []
        raise FileNotFoundError(f"no shipped model {name!r} in {MODELS_DIR}; available: {have}")
    return str(path)


def adapter_path(name: str) -> str:
    """Folder of a shipped LoRA adapter (PEFT format; trained by scripts/train_lora_adapter.py).

    Raises:
        FileNotFoundError: if the package holds no such adapter, naming the ones it has.
    """
    path = ADAPTERS_DIR / name
    if not (path / "adapter_config.json").is_file():
        have = sorted(p.name for p in ADAPTERS_DIR.iterdir() if (p / "adapter_config.json").is_file()) \
            if ADAPTERS_DIR.is_dir() else []
        raise FileNotFoundError(f"no shipped adapter {name!r} in {ADAPTERS_DIR}; available: {have}")
    return str(path)


def default_model_path() -> str:
    """The default model: the shipped Shakespeare target model."""
    return model_path(DEFAULT_MODEL_NAME)
