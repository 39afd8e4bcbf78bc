"""Reading a GGUF file's metadata into an HF config, for the families transformers' own GGUF
reader does not know (deepseek2, mamba2, qwen3next, qwen35, granitehybrid,
falcon-h1): what their `gguf_hf_config` share.

`GGUFKeys` looks keys up under the file's architecture prefix (llama.cpp's `{arch}.` + key, as
its `LLM_KV_*` names) and raises a ValueError that names the missing or bad key, so a malformed
file fails while its checkpoint view is built, before any weight is read.
"""

from __future__ import annotations

from typing import Any

_REQUIRED = object()


class GGUFKeys:
    """The metadata of one file (`model_loader.gguf.metadata_values`) under `arch`.

    Args:
        metadata: key -> value (numbers, strings, bools, lists for arrays).
        arch: the file's `general.architecture` (the key prefix).
    """

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """`{arch}.{key}`; `default` when absent, or ValueError naming it when required."""
        full = f"{self.arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is _REQUIRED:
            raise ValueError(f"metadata key {full!r} is missing")
        return default

    def integer(self, key: str, default: Any = _REQUIRED) -> int | None:
        """An integer key; a per-layer array must hold one value for every layer.

        Raises:
            ValueError: naming the key when missing (and required), not an integer, or an
                array of different values.
        """
        value = self.get(key, default)
        if value is None or value is default:
            return value
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise ValueError(f"metadata key {self.arch}.{key} = {value}: per-layer values "
                                 f"that differ are not supported")
            value = value[0]
        if isinstance(value, bool) or not float(value).is_integer():
            raise ValueError(f"metadata key {self.arch}.{key} = {value!r} is not an integer")
        return int(value)

    def number(self, key: str, default: Any = _REQUIRED) -> float | None:
        value = self.get(key, default)
        if value is None or value is default:
            return value
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metadata key {self.arch}.{key} = {value!r} is not a "
                             f"number") from None


def vocab_size(keys: GGUFKeys, tensors: dict[str, tuple[int, ...]]) -> int:
    """`{arch}.vocab_size`, else the rows of `token_embd.weight`.

    Raises:
        ValueError: neither is there.
    """
    size = keys.integer("vocab_size", None)
    if size is not None:
        return size
    if "token_embd.weight" not in tensors:
        raise ValueError(f"metadata key '{keys.arch}.vocab_size' and tensor token_embd.weight "
                         f"are both missing")
    return tensors["token_embd.weight"][0]
