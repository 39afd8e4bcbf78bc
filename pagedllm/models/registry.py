"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from pagedllm.models.bert import BertForMaskedLM, BertModel
from pagedllm.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                   Qwen3ForCausalLM)

_MODELS = {cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                         Qwen3ForCausalLM, BertModel, BertForMaskedLM)}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: tuple[str, ...] | list[str]):
    """First supported class among `architectures`.

    Raises:
        ValueError: naming the architectures and listing the supported ones.
    """
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"unsupported model architecture(s) {list(architectures)}; supported: "
                     f"{supported_architectures()}")
