"""LoRAConfig: the engine's LoRA limits (vLLM's `enable_lora` family of engine arguments)."""

from __future__ import annotations

from dataclasses import dataclass

# Architectures whose layers the LoRA wrappers know (the Llama family of models/llama.py; the
# MoE families of models/mixtral.py, olmoe.py, qwen_moe.py, deepseek_v2.py and glm4_moe.py,
# shared experts and dense layers among the sparse ones included).
LORA_MOE_ARCHITECTURES = ("MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM",
                          "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                          "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", *LORA_MOE_ARCHITECTURES)


def check_lora_architectures(architectures: list[str] | tuple[str, ...]) -> None:
    """Raises ValueError unless every one of a model's `architectures` (config.json) is in
    LORA_ARCHITECTURES (an empty list: unknown, refused too)."""
    unsupported = [a for a in architectures if a not in LORA_ARCHITECTURES]
    if unsupported or not architectures:
        raise ValueError(f"enable_lora: architecture {unsupported or 'unknown'} has no LoRA "
                         f"support yet; supported: {list(LORA_ARCHITECTURES)}")


@dataclass(frozen=True)
class LoRAConfig:
    """Present in `EngineConfig.lora_config` only with `enable_lora`.

    Attributes:
        max_loras: most distinct adapters in one step (the worker's device slots; the
            scheduler budgets them like tokens).
        max_lora_rank: the largest adapter rank accepted; every slot is this wide.
        max_cpu_loras: adapters kept loaded in host memory (an LRU); None = `max_loras`.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if (isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int)
                or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {self.max_cpu_loras!r}")
