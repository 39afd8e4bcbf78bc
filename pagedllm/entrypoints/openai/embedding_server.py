"""The HTTP app of an embedding model (`pagedllm serve --runner pooling`).

Routes: GET /health, GET /v1/models, POST /v1/embeddings, POST /tokenize (the text form only),
POST /detokenize. Errors, request validation (400) and API keys behave as in
`api_server.build_app`, whose handlers and middleware are reused; there is no engine thread to
start or stop (embedding calls run in worker threads, see serving_embedding.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.entrypoints.openai.api_server import (MAX_REQUEST_BODY_BYTES,
                                                    _cancel_on_disconnect, _respond,
                                                    install_auth_and_error_handlers)
from pagedllm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagedllm.entrypoints.openai.serving_embedding import ServingEmbedding
from pagedllm.entrypoints.openai.serving_models import model_list
from pagedllm.entrypoints.openai.serving_tokenization import (ServingTokenization,
                                                              add_tokenization_routes)


def build_embedding_app(engine: PoolingEngine, served_model_names: Sequence[str],
                        api_key: str | None = None, model_root: str | None = None,
                        max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """The FastAPI app over a loaded `PoolingEngine`.

    Args:
        engine: the embedding engine.
        served_model_names: names accepted in a request's `model` (the first is reported back).
        api_key: require `Authorization: Bearer <api_key>` on every route but /health.
        model_root: the checkpoint path shown as `root` in /v1/models.
        max_request_body_bytes: larger request bodies get 413.
    """
    embeddings = ServingEmbedding(engine, served_model_names)
    # NOTE(embedding_server): a tokenizer of its own: the engine's worker thread switches its
    # tokenizer's truncation on and off per call (`truncate_prompt_tokens`), and a concurrent
    # call on the same tokenizer from another thread can be truncated too.
    tokenizer = copy.deepcopy(engine.tokenizer)
    gate = InputProcessor(tokenizer, engine.max_model_len, engine.vocab_size, eos_token_ids=())
    tokenization = ServingTokenization(tokenizer, engine.vocab_size, engine.max_model_len,
                                       gate.max_prompt_chars(engine.max_model_len),
                                       embeddings._check_model)
    app = FastAPI(title="pagedllm OpenAI-compatible embedding server")
    install_auth_and_error_handlers(app, api_key, max_request_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(model_list(embeddings.served_model_names, model_root,
                                       engine.max_model_len).model_dump())

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return _respond(await _cancel_on_disconnect(request,
                                                    embeddings.create_embedding(body)))

    add_tokenization_routes(app, tokenization)
    return app
