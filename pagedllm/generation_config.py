"""A checkpoint's generation config as the default sampling parameters of requests that leave
them out (vLLM's `--generation-config` / `--override-generation-config`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig

# The sampling defaults a generation config may recommend (vLLM's set), HF name -> SamplingParams
# field; HF's max_new_tokens is vLLM's max_tokens. `do_sample` is not among them: vLLM ignores it.
GENERATION_CONFIG_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p",
                                   "top_k": "top_k", "min_p": "min_p",
                                   "repetition_penalty": "repetition_penalty",
                                   "max_new_tokens": "max_tokens"}


def read_generation_config(folder: str) -> tuple[dict[str, Any], Path]:
    """The values a folder's generation_config.json sets explicitly (transformers'
    `GenerationConfig.to_diff_dict`, so none of GenerationConfig's own defaults), and the file's
    path; ({}, path) when there is no such file.

    Raises:
        ValueError: naming the file when transformers cannot read it (not JSON, or a value
            transformers refuses, such as max_new_tokens 0).
    """
    from transformers import GenerationConfig

    path = Path(folder).expanduser() / "generation_config.json"
    if not path.is_file():
        return {}, path
    try:
        config = GenerationConfig.from_pretrained(str(path.parent), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"invalid generation config {path}: {e}") from e
    return config.to_diff_dict(), path


def get_diff_sampling_param(model_config: ModelConfig, model_path: str) -> dict[str, Any]:
    """The default sampling parameters of requests that leave them out (vLLM's
    `ModelConfig.get_diff_sampling_param`): the generation config's temperature, top_p, top_k,
    min_p, repetition_penalty and max_new_tokens (as max_tokens) where it sets them, with
    `override_generation_config` on top; {} for `generation_config="vllm"` without overrides.

    `model_path` is the resolved checkpoint folder (a .gguf file's view, whose
    generation_config.json holds the file's `general.sampling.*` values).

    Raises:
        ValueError: naming the file (or override_generation_config) and the key of a value a
            request could not carry either (e.g. top_p 2), or a corrupt file.
        FileNotFoundError: a `generation_config` folder without generation_config.json.
    """
    from pagedllm.sampling_params import SamplingParams

    sources: list[tuple[str, dict[str, Any]]] = []
    if model_config.generation_config != "vllm":
        folder = model_path if model_config.generation_config == "auto" \
            else model_config.generation_config
        values, path = read_generation_config(folder)
        if model_config.generation_config != "auto" and not path.is_file():
            raise FileNotFoundError(f"generation_config: {path} not found")
        sources.append((str(path), values))
    sources.append(("override_generation_config", model_config.override_generation_config))
    defaults: dict[str, Any] = {}
    for source, values in sources:
        for key, name in GENERATION_CONFIG_SAMPLING_KEYS.items():
            value = values.get(key)
            if value is None:
                continue
            try:
                SamplingParams(**{name: value})
            except ValueError as e:
                raise ValueError(f"{source}: {key} = {value!r} cannot be a default sampling "
                                 f"parameter ({e})") from e
            defaults[name] = value
    return defaults
