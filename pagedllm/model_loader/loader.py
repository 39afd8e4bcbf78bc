"""Build a model from its HF config and fill it from safetensors files (with or without index).

Parameters are created empty on the target device in the target dtype and filled through each
parameter's `weight_loader`; a checkpoint that leaves a parameter unset is an error naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.models.registry import resolve_model_class


def _safetensors_files(model_path: str) -> list[Path]:
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"corrupt checkpoint index {index}: {e}") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"checkpoint shard listed in {index.name} is missing: {f}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def iterate_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, file by file (memory-mapped).

    Raises:
        FileNotFoundError: missing weight files, naming them.
        ValueError: a file that is not valid safetensors, naming it.
    """
    for path in _safetensors_files(model_path):
        try:
            f = safe_open(str(path), framework="pt")
            names = list(f.keys())
        except Exception as e:  # safetensors raises its own SafetensorError and OSErrors
            raise ValueError(f"corrupt checkpoint file {path}: {e}") from e
        for name in names:
            try:
                tensor = f.get_tensor(name)
            except Exception as e:
                raise ValueError(f"corrupt checkpoint file {path} (tensor {name}): {e}") from e
            yield name, tensor


@contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def load_model(model_path: str, hf_config, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Instantiate the registered class for `hf_config.architectures` and load its weights.

    Raises:
        ValueError: unsupported architecture, corrupt files, or weights missing from the checkpoint.
    """
    cls = resolve_model_class(tuple(getattr(hf_config, "architectures", None) or ()))
    with torch.device(device), _default_dtype(dtype):
        model = cls(hf_config)
    try:
        loaded = model.load_weights(
            (name, tensor.to(dtype)) for name, tensor in iterate_safetensors(model_path))
    except ValueError as e:
        raise ValueError(f"loading {model_path}: {e}") from e
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights for: {sorted(missing)[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    return model.eval()
