"""POST /v1/embeddings over a `PoolingEngine`: input forms, encoding formats, usage, errors.

All inputs of one HTTP request are embedded by one `PoolingEngine.encode` call (batched under the
token budget). The engine is synchronous and not thread-safe: calls run in a worker thread, one at
a time (an asyncio lock), so the event loop keeps answering while a batch runs; concurrent HTTP
requests are queued, not merged into one batch (docs/embeddings.md).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence

import numpy as np

from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.entrypoints.openai.protocol import UsageInfo
from pagedllm.entrypoints.openai.protocol_embedding import (EmbeddingData, EmbeddingRequest,
                                                            EmbeddingResponse)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError
from pagedllm.pooling.params import PoolingParams


def encode_base64(embedding: list[float]) -> str:
    """OpenAI's base64 format: the vector as little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


class ServingEmbedding:
    """Answers embedding requests.

    Args:
        engine: the loaded pooling engine.
        served_model_names: names a request's `model` may use; the first is reported back.
    """

    def __init__(self, engine: PoolingEngine, served_model_names: Sequence[str]) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self._lock = asyncio.Lock()

    def _check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        raise OpenAIServingError(f"The model `{model}` does not exist.", 404, param="model",
                                 code="model_not_found")

    def _prompts(self, request: EmbeddingRequest) -> list[str | list[int]]:
        inp = request.input
        if isinstance(inp, str):
            return [inp]
        if not inp:
            raise OpenAIServingError("input must not be empty", 400, param="input")
        if all(isinstance(t, int) for t in inp):
            return [list(inp)]
        return list(inp)

    def _check_dimensions(self, request: EmbeddingRequest) -> None:
        # NOTE(serving_embedding): no supported model is Matryoshka-trained, so only the native
        # size is accepted; truncating other vectors would silently degrade them.
        d = request.dimensions
        if d is not None and d != self.engine.hidden_size:
            raise OpenAIServingError(
                f"dimensions={d} is not supported by this model: it is not trained for reduced "
                f"dimensions (Matryoshka); its embeddings have {self.engine.hidden_size}", 400,
                param="dimensions")

    async def _encode(self, prompts: list[str | list[int]], params: PoolingParams):
        async with self._lock:
            return await asyncio.to_thread(self.engine.encode, prompts, params)

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Embed `request.input`.

        Raises:
            OpenAIServingError: 404 unknown model; 400 empty input, unsupported dimensions,
                over-long or invalid prompts (the message names the input index and the limit).
        """
        model = self._check_model(request.model)
        self._check_dimensions(request)
        prompts = self._prompts(request)
        try:
            params = PoolingParams(normalize=request.normalize,
                                   truncate_prompt_tokens=request.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, param="truncate_prompt_tokens") from e
        try:
            # Shielded: a client that goes away cancels the wait, not the running batch, so the
            # lock stays held until the engine call has really finished.
            outputs = await asyncio.shield(asyncio.ensure_future(self._encode(prompts, params)))
        except ValueError as e:
            raise OpenAIServingError(str(e).replace("prompt ", "input ", 1), 400,
                                     param="input") from e
        data = [EmbeddingData(index=i, embedding=(encode_base64(o.outputs.embedding)
                                                  if request.encoding_format == "base64"
                                                  else o.outputs.embedding))
                for i, o in enumerate(outputs)]
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return EmbeddingResponse(model=model, data=data,
                                 usage=UsageInfo(prompt_tokens=num_tokens,
                                                 total_tokens=num_tokens))
