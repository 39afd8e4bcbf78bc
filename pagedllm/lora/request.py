"""LoRARequest: which adapter a request runs under (vLLM's `vllm.lora.request.LoRARequest`).

Plain Python, no torch: it rides on requests through the scheduler and across processes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter as requests name it.

    Attributes:
        lora_name: the adapter's name (the server's `model` field selects adapters by it).
        lora_int_id: a positive integer that identifies this adapter for the engine's life:
            the worker's slots and the prefix cache's block hashes key on it, so one id must
            always mean the same adapter (the engine refuses a second name or path under it).
        lora_path: a folder in PEFT's format (`adapter_config.json` +
            `adapter_model.safetensors`).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of `lora_int_id`."""
        return self.lora_int_id


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter the server serves from its start (`--lora-modules`, vLLM's): its name, PEFT
    folder and base model name (None: the served model's first name)."""

    name: str
    path: str
    base_model_name: str | None = None
