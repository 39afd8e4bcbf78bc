"""What the engine reads from a checkpoint's Hugging Face config files before it builds anything:
`config.json` (architectures, context, vocabulary, the window that caps a context) and
`generation_config.json` (EOS ids). Plain JSON reading; no transformers import."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class HFModelInfo:
    """Facts read once from the checkpoint's config.json that the scheduler side needs."""

    architectures: tuple[str, ...]
    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)



def read_hf_config(model_path: str) -> dict[str, Any]:
    """Read `config.json` of a local checkpoint folder.

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: naming the file when it is not valid JSON.
    """
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint config not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt checkpoint config {path}: {e}") from e


def _eos_ids(model_path: str, hf: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    gen_path = Path(model_path) / "generation_config.json"
    sources = [hf.get("eos_token_id")]
    if gen_path.is_file():
        try:
            sources.insert(0, json.loads(gen_path.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise ValueError(f"corrupt generation config {gen_path}: {e}") from e
    for src in sources:
        for i in (src if isinstance(src, list) else [src]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


# Architectures whose attention layers apply their own sliding windows (models/gemma.py,
# models/llama.py's `layer_sliding_windows`).
_LAYER_WINDOW_ARCHITECTURES = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                         "Gemma3ForConditionalGeneration",
                                         "MistralForCausalLM", "Qwen2ForCausalLM",
                                         "Qwen3ForCausalLM"})


def context_sliding_window(hf: dict[str, Any]) -> int | None:
    """The window that caps the context of a sliding-window model whose layers attend over the
    full context (Phi-3; a GGUF Mistral loaded as Llama); None for the others, and for
    architectures whose layers apply their own windows (Gemma 2 and 3, Mistral, Qwen2/3)."""
    if _LAYER_WINDOW_ARCHITECTURES & set(hf.get("architectures") or ()):
        return None
    text = hf.get("text_config", hf)
    window = text.get("sliding_window")
    if not isinstance(window, int) or ("use_sliding_window" in text
                                       and not text["use_sliding_window"]):
        return None
    return window


def _positive_int(text: dict[str, Any], key: str, default: int | None, model_path: str) -> int:
    value = text.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{Path(model_path) / 'config.json'}: {key} must be an int >= 1, got "
                         f"{'nothing' if value is None else repr(value)}")
    return value


def hf_model_info(model_path: str) -> HFModelInfo:
    """Summarise a checkpoint's config.json (and generation_config.json for EOS ids).

    Raises:
        FileNotFoundError, ValueError: as `read_hf_config`; ValueError also for a
            `max_position_embeddings` (default 2048) or `vocab_size` (required) that is not an
            int >= 1, naming the field.
    """
    hf = read_hf_config(model_path)
    text = hf.get("text_config", hf)
    return HFModelInfo(
        architectures=tuple(hf.get("architectures") or ()),
        max_position_embeddings=_positive_int(text, "max_position_embeddings", 2048, model_path),
        vocab_size=_positive_int(text, "vocab_size", None, model_path),
        eos_token_ids=_eos_ids(model_path, hf),
        bos_token_id=text.get("bos_token_id"),
        raw=hf,
    )
