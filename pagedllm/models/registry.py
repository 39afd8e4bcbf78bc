"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from pagedllm.models.bert import BertForMaskedLM, BertModel
from pagedllm.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pagedllm.models.deepseek_v32 import DeepseekV32ForCausalLM
from pagedllm.models.falcon_h1 import FalconH1ForCausalLM
from pagedllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagedllm.models.glm4_moe import Glm4MoeForCausalLM
from pagedllm.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from pagedllm.models.idefics3 import (Idefics3ForConditionalGeneration,
                                      SmolVLMForConditionalGeneration)
from pagedllm.models.lfm2 import Lfm2ForCausalLM
from pagedllm.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                   Qwen3ForCausalLM)
from pagedllm.models.mamba2 import Mamba2ForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.olmoe import OlmoeForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2_5_vl import (Qwen2_5_VLForConditionalGeneration,
                                        Qwen2VLForConditionalGeneration)
from pagedllm.models.qwen3_vl import Qwen3VLForConditionalGeneration
from pagedllm.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3NextForCausalLM
from pagedllm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS = {cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                         Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM,
                                         Gemma3ForCausalLM, BertModel, BertForMaskedLM,
                                         MixtralForCausalLM, Qwen2MoeForCausalLM,
                                         Qwen3MoeForCausalLM, OlmoeForCausalLM,
                                         DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,
                                         DeepseekV32ForCausalLM,
                                         Glm4MoeForCausalLM,
                                         Idefics3ForConditionalGeneration,
                                         SmolVLMForConditionalGeneration,
                                         Gemma3ForConditionalGeneration,
                                         Mamba2ForCausalLM, Lfm2ForCausalLM,
                                         Qwen3NextForCausalLM, Qwen3_5ForCausalLM,
                                         GraniteMoeHybridForCausalLM, FalconH1ForCausalLM,
                                         Qwen2VLForConditionalGeneration,
                                         Qwen2_5_VLForConditionalGeneration,
                                         Qwen3VLForConditionalGeneration)}


# GGUF `general.architecture` (llama.cpp's names) -> class.
_GGUF_MODELS = {cls.gguf_architecture: cls for cls in _MODELS.values()
                if getattr(cls, "gguf_architecture", None)}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_gguf_architecture(architecture: str | None, path: str = "the GGUF file"):
    """The class that loads a GGUF file of `architecture` (its `general.architecture`).

    Raises:
        ValueError: naming the architecture and the file, and listing the supported ones.
    """
    if architecture in _GGUF_MODELS:
        return _GGUF_MODELS[architecture]
    raise ValueError(f"GGUF architecture {architecture!r} of {path} is not supported; "
                     f"supported: {sorted(_GGUF_MODELS)}")


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
