"""pagedllm: LLM inference and serving over a paged KV cache."""

from pagedllm.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.entrypoints.llm import LLM, GenerateError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "GenerateError", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "BeamSearchParams", "BeamSearchOutput",
           "PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput"]
__version__ = "0.1.0"
