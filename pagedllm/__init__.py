"""pagedllm: LLM inference and serving over a paged KV cache.

The public names are imported on first use (PEP 562 `__getattr__`), so `import pagedllm` and
`pagedllm --help` stay fast: torch and transformers load only when an engine is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedllm.omp_wait import apply_default_wait_policy

apply_default_wait_policy()     # before anything loads torch's OpenMP runtime

if TYPE_CHECKING:
    from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams
    from pagedllm.entrypoints.llm import LLM, GenerateError
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedllm.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput
    from pagedllm.pooling.params import PoolingParams
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm", "GenerateError": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs", "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "LoRARequest": "pagedllm.lora.request",
    "BeamSearchParams": "pagedllm.beam_search",
    "BeamSearchOutput": "pagedllm.beam_search",
    "PoolingParams": "pagedllm.pooling.params",
    "EmbeddingOutput": "pagedllm.pooling.outputs",
    "EmbeddingRequestOutput": "pagedllm.pooling.outputs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
