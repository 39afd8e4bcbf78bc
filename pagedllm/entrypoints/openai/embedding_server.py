"""The HTTP app of an embedding model (`pagedllm serve --runner pooling`).

Routes: GET /health, GET /v1/models, POST /v1/embeddings. Errors, request validation (400) and API
keys behave as in `api_server.build_app`, whose handlers and middleware are reused; there is no
engine thread to start or stop (embedding calls run in worker threads, see serving_embedding.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.entrypoints.openai.api_server import (_cancel_on_disconnect, _respond,
                                                    install_auth_and_error_handlers)
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList
from pagedllm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagedllm.entrypoints.openai.serving_embedding import ServingEmbedding



def build_embedding_app(engine: PoolingEngine, served_model_names: Sequence[str],
                        api_key: str | None = None, model_root: str | None = None) -> FastAPI:
    """The FastAPI app over a loaded `PoolingEngine`.

    Args:
        engine: the embedding engine.
        served_model_names: names accepted in a request's `model` (the first is reported back).
        api_key: require `Authorization: Bearer <api_key>` on every route but /health.
        model_root: the checkpoint path shown as `root` in /v1/models.
    """
    embeddings = ServingEmbedding(engine, served_model_names)
    app = FastAPI(title="pagedllm OpenAI-compatible embedding server")
    install_auth_and_error_handlers(app, api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [ModelCard(id=name, root=model_root, max_model_len=engine.max_model_len)
                 for name in served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return _respond(await _cancel_on_disconnect(request,
                                                    embeddings.create_embedding(body)))

    return app
