"""Build a model from its HF config and fill it from safetensors files (with or without index)
or from the GGUF file behind a checkpoint view (model_loader/gguf.py).

Parameters are created empty on the target device in the target dtype and filled through each
parameter's `weight_loader`; a checkpoint that leaves a parameter unset is an error naming it.
Tensors reach the loaders lazily (`CheckpointTensor`, `GGUFTensor`): a tensor-parallel rank
narrows them to its shard and only that slice is read from disk (safetensors `get_slice`) or
dequantized (GGUF rows). With `quantization="gguf"` (the default for a GGUF file on the CPU)
linear layers keep their GGUF blocks instead (layers/quantization/gguf.py), as do the token
embedding and LM head when their type has a kernel; norms are dequantized.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.model_loader.gguf import iterate_gguf_tensors, read_gguf_source
from pagedllm.model_loader.slicing import narrow_index
from pagedllm.models.registry import resolve_model_class
from pagedllm.native.attach import attach_native_decoder
from pagedllm.native.moe_block import attach_native_moe

logger = logging.getLogger(__name__)


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


class CheckpointTensor:
    """A checkpoint tensor not read yet; `narrow` selects a slice, `materialize` reads only it.

    Weight loaders treat it like a tensor for `shape` and `narrow(dim, start, length)`;
    `layers.linear.default_weight_loader` calls `materialize()`, which returns the selected slice
    converted to `dtype`.

    Raises (from `narrow`): ValueError for a slice outside the tensor. (From `materialize`):
    ValueError naming the file and tensor when the bytes cannot be read.
    """

    def __init__(self, path: Path, handle, name: str, dtype: torch.dtype,
                 shape: tuple[int, ...] | None = None,
                 index: tuple[slice, ...] | None = None) -> None:
        self._path, self._handle, self._name, self.dtype = path, handle, name, dtype
        if shape is None:
            shape = tuple(handle.get_slice(name).get_shape())
        self.shape = torch.Size(shape)
        self._index = index

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        shape, index = narrow_index(self.shape, self._index, dim, start, length,
                                    f"checkpoint tensor {self._name}")
        return CheckpointTensor(self._path, self._handle, self._name, self.dtype, shape, index)

    def materialize(self) -> torch.Tensor:
        try:
            if self._index is None:
                tensor = self._handle.get_tensor(self._name)
            else:
                tensor = self._handle.get_slice(self._name)[self._index]
        except Exception as e:  # safetensors raises its own SafetensorError and OSErrors
            raise ValueError(f"corrupt checkpoint file {self._path} (tensor {self._name}): "
                             f"{e}") from e
        return tensor.to(self.dtype)



def iterate_checkpoint_tensors(model_path: str,
                               dtype: torch.dtype) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (name, lazy tensor) for every tensor of the checkpoint; nothing is read yet.

    Raises:
        FileNotFoundError: missing weight files, naming them.
        ValueError: a file whose header is not valid safetensors, naming it.
    """
    for path in _safetensors_files(model_path):
        try:
            f = safe_open(str(path), framework="pt")
            names = list(f.keys())
        except Exception as e:  # safetensors raises its own SafetensorError and OSErrors
            raise ValueError(f"corrupt checkpoint file {path}: {e}") from e
        for name in names:
            try:
                tensor = CheckpointTensor(path, f, name, dtype)
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


def _quantization_for(quantization: str | None, source, device: torch.device) -> str:
    """The linear layers' method name: `quantization` itself, or for None "gguf" for a GGUF
    file on the CPU with the native kernels built, else "none".

    Raises:
        ValueError: "gguf" for a non-GGUF checkpoint, another device, or without the kernels;
            "int8"/"w8a8" for a GGUF checkpoint.
    """
    from pagedllm.native.kernels import cpu_kernels

    if quantization not in (None, "none", "gguf", "int8", "w8a8"):
        raise ValueError(f"quantization must be None, 'none', 'gguf', 'int8' or 'w8a8', got "
                         f"{quantization!r}")
    if quantization == "none":
        return "none"
    if quantization in ("int8", "w8a8"):
        if source is not None:
            raise ValueError(f"quantization={quantization!r} quantizes a float (safetensors) "
                             f"checkpoint at load; a .gguf model keeps its own blocks: use "
                             f"quantization='gguf' or 'none'")
        return quantization
    usable = source is not None and torch.device(device).type == "cpu"
    if quantization == "gguf":
        if not usable:
            raise ValueError("quantization='gguf' needs a .gguf model on the CPU")
        if cpu_kernels() is None:
            raise ValueError("quantization='gguf' needs the native CPU kernels, which are "
                             "unavailable here (see the log); use quantization='none'")
        return "gguf"
    return "gguf" if usable and cpu_kernels() is not None else "none"


def load_model(model_path: str, hf_config, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None) -> nn.Module:
    """Instantiate the registered class for `hf_config.architectures` and load its weights.

    `model_path` is a safetensors checkpoint folder or a GGUF checkpoint view; a GGUF file's
    tensors are renamed by the model family (`gguf_checkpoint_weights`). `quantization`: "none"
    dequantizes them at load; "gguf" keeps the linear layers' weights in their blocks; "int8" /
    "w8a8" quantize a safetensors checkpoint's linear weights per channel at load
    (layers/quantization/int8.py); None
    (the default) picks "gguf" for a GGUF file on the CPU, falling back to "none" (logged) when
    a linear weight's type has no kernel (fused layers of mixed types stay quantized).

    Raises:
        ValueError: unsupported architecture or tensor type, corrupt files, weights missing
            from the checkpoint, or a `quantization` that cannot apply (naming why).
        FileNotFoundError: the GGUF file behind a view is gone.
    """
    from pagedllm.layers.quantization.gguf import GGUFLayoutUnsupported

    cls = resolve_model_class(tuple(getattr(hf_config, "architectures", None) or ()))
    source = read_gguf_source(model_path)
    if source is not None and not hasattr(cls, "gguf_checkpoint_weights"):
        raise ValueError(f"{cls.__name__} cannot load GGUF files ({source.path})")
    method = _quantization_for(quantization, source, device)
    if method == "none":
        return _load(cls, model_path, source, hf_config, dtype, device, "none")
    try:
        return _load(cls, model_path, source, hf_config, dtype, device, method)
    except GGUFLayoutUnsupported as e:
        if quantization is not None:
            raise
        logger.info("GGUF weights dequantized at load: %s", e)
        return _load(cls, model_path, source, hf_config, dtype, device, "none")


def _load(cls, model_path: str, source, hf_config, dtype: torch.dtype, device: torch.device,
          quantization: str) -> nn.Module:
    from pagedllm.layers.quantization import quantize_linear_layers
    from pagedllm.layers.quantization.base import process_weights_after_loading
    from pagedllm.layers.quantization.gguf import GGUFLayoutUnsupported

    checkpoint = model_path if source is None else source.path
    with torch.device(device), _default_dtype(dtype):
        model = cls(hf_config)
    if quantization != "none":
        quantize_linear_layers(model, quantization)
    try:
        if source is None:
            weights = iterate_checkpoint_tensors(model_path, dtype)
        else:
            weights = cls.gguf_checkpoint_weights(hf_config, iterate_gguf_tensors(source, dtype))
        loaded = model.load_weights(weights)
    except GGUFLayoutUnsupported as e:
        raise GGUFLayoutUnsupported(f"loading {checkpoint}: {e}") from e
    except ValueError as e:
        raise ValueError(f"loading {checkpoint}: {e}") from e
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {checkpoint} lacks weights for: {sorted(missing)[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    process_weights_after_loading(model)
    attach_native_moe(model)   # the CPU native MoE blocks, where they take the blocks
    attach_native_decoder(model)   # the CPU fused decoder / native stacks (over those blocks)
    return model.eval()
