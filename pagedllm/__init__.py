"""pagedllm: LLM inference and serving over a paged KV cache."""

from pagedllm.entrypoints.llm import LLM, GenerateError
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "GenerateError", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
