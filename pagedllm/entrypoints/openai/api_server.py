"""The OpenAI-compatible HTTP server: FastAPI app factory (`build_app`) and `run_server`.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses, GET /v1/responses/{response_id}, POST /v1/messages,
POST /v1/messages/count_tokens (Anthropic's), POST /tokenize, POST /detokenize,
POST /reset_prefix_cache, GET /metrics (docs/openai_api.md).
Every error is OpenAI's error object with a 4xx/5xx status (Anthropic's on /v1/messages...);
request validation errors (wrong types, malformed JSON) are 400, as OpenAI answers them. With an
API key, every route but /health and /metrics needs `Authorization: Bearer <key>` or
`x-api-key: <key>`.

Shutdown: uvicorn handles SIGINT/SIGTERM (stop accepting, let open requests finish up to a grace
period); a second before it ends the engine stops, so the requests still open get a 503 error
object; the app's lifespan then finishes stopping the engine thread. If the engine itself dies
(the model forward or a worker failed), every pending request fails at once, new ones get 503,
and the server shuts down and exits with status 1 so a supervisor restarts it (as vLLM does). Request bodies over `max_request_body_bytes` get 413.
Run as `python -m pagedllm.entrypoints.openai.api_server [serve flags]`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.dp_async_llm import DataParallelAsyncLLM
from pagedllm.entrypoints.openai.anthropic_errors import AnthropicErrorMiddleware
from pagedllm.entrypoints.openai.dev_routes import add_dev_routes
from pagedllm.entrypoints.openai.metrics import METRICS_CONTENT_TYPE, PrometheusStatLogger
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  TokenizeRequest)
from pagedllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_completion import ServingCompletion
from pagedllm.entrypoints.openai.serving_responses import ServingResponses
from pagedllm.entrypoints.openai.serving_engine import (OpenAIServing, OpenAIServingError,
                                                        SSEStream, error_from_exception)
from pagedllm.entrypoints.openai.serving_lora import LoRAModules, add_lora_routes
from pagedllm.entrypoints.openai.serving_messages import ServingMessages
from pagedllm.entrypoints.openai.serving_models import model_list, resolve_served_model_names
from pagedllm.lora.request import LoRAModulePath
from pagedllm.multimodal.fetch import MediaFetcher
from pagedllm.entrypoints.openai.serving_tokenization import (ServingTokenization,
                                                              add_tokenization_routes)
from pagedllm.logger import init_logger

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/metrics")
# Seconds uvicorn waits for open requests on SIGINT/SIGTERM before cancelling them.
GRACEFUL_SHUTDOWN_S = 5
# Default cap on a request body (bytes): a prompt of 128k token ids as JSON is about 1 MB.
MAX_REQUEST_BODY_BYTES = 8 << 20


def _error_response(error: OpenAIServingError) -> JSONResponse:
    return JSONResponse(error.to_response().model_dump(), status_code=error.status_code)


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 unless `Authorization: Bearer <api_key>` or `x-api-key:
    <api_key>` (Anthropic's header) is sent (open paths excepted).

    Pure ASGI rather than `@app.middleware("http")` so streamed responses and client-disconnect
    detection pass through untouched.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.api_key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if secrets.compare_digest(headers.get(b"authorization", b""), self.expected) or \
                secrets.compare_digest(headers.get(b"x-api-key", b""), self.api_key):
            await self.app(scope, receive, send)
            return
        response = _error_response(OpenAIServingError(
            "Incorrect or missing API key (send `Authorization: Bearer <key>` or "
            "`x-api-key: <key>`).", 401,
            code="invalid_api_key"))
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: 413 for a request body over `max_bytes`, whether announced by
    Content-Length or sent chunked (then read up to the limit and replayed to the app)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)  # h11 enforces the announced length
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        response = _error_response(OpenAIServingError(
            f"the request body is larger than {self.max_bytes} bytes", 413,
            code="request_too_large"))
        await response(scope, receive, send)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, handler: Awaitable[Any]) -> Any:
    """Run `handler`, cancelling it (which aborts its engine requests) if the client goes away.

    Needed for non-streamed answers only: Starlette already stops a streamed response.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it: the client is gone
    if watcher.done() and not watcher.cancelled() and isinstance(task.result(), SSEStream):
        task.result().close()  # admitted as the client left: nobody will stream it
        return Response(status_code=499)
    return task.result()


class _SSEResponse(StreamingResponse):
    """A streamed answer that closes its engine streams however the response ends: finished,
    client gone, cancelled, or failed before the first byte (which aborts what still runs)."""

    def __init__(self, stream: SSEStream, headers: dict[str, str] | None = None) -> None:
        super().__init__(stream.events, media_type="text/event-stream", headers=headers)
        self._stream = stream

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def _respond(result: Any, request_id: str | None = None) -> Response:
    """The HTTP response of a handler's result; a request's own `request_id` (vLLM's field) is
    echoed in its X-Request-Id header."""
    if isinstance(result, Response):
        return result
    headers = {"X-Request-Id": request_id} if request_id is not None else None
    if isinstance(result, SSEStream):
        return _SSEResponse(result, headers)
    return JSONResponse(result.model_dump(), headers=headers)


def _validation_error(exc: RequestValidationError) -> OpenAIServingError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return OpenAIServingError(f"malformed JSON body: {first.get('ctx', {}).get('error', '')}",
                                  400)
    def where(error: dict) -> list[str]:
        loc = [str(part) for part in error.get("loc", ())][1:]  # after "body"
        field = error.get("ctx", {}).get("field")
        return loc or ([field] if field is not None else [])
    loc = where(first)
    details = "; ".join(f"{'.'.join(where(e)) or 'body'}: {e.get('msg')}" for e in errors)
    return OpenAIServingError(f"invalid request: {details}", 400, param=loc[0] if loc else None)


def install_auth_and_error_handlers(app: FastAPI, api_key: str | None,
                                    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES) -> None:
    """Body-size cap (413), bearer-key check (when `api_key` is set) and OpenAI-shaped error
    bodies for every error class: serving errors, request validation (400), HTTP errors,
    unhandled exceptions (500)."""
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)

    @app.exception_handler(OpenAIServingError)
    async def _on_serving_error(request: Request, exc: OpenAIServingError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):   # FastAPI's "error parsing the body"
            return _error_response(OpenAIServingError(
                f"malformed JSON body: not UTF-8 text ({exc.__cause__.reason} at byte "
                f"{exc.__cause__.start})", 400))
        return _error_response(OpenAIServingError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def _on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        return _error_response(OpenAIServingError(f"internal error: {type(exc).__name__}", 500))


def build_app(async_llm: AsyncLLM | DataParallelAsyncLLM, served_model_names: Sequence[str],
              metrics: PrometheusStatLogger | None = None, api_key: str | None = None,
              model_root: str | None = None,
              max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None,
              trust_request_chat_template: bool = False,
              lora_modules: Sequence[LoRAModulePath] = (),
              allow_runtime_lora_updating: bool = False,
              dev_mode: bool | None = None,
              media_fetcher: MediaFetcher | None = None) -> FastAPI:
    """The FastAPI app over a (not necessarily started) `AsyncLLM`.

    Args:
        async_llm: the engine; started in the app's lifespan, shut down when the app stops.
        served_model_names: names accepted in a request's `model` (the first is reported back).
        metrics: the stat logger given to `async_llm` (GET /metrics renders it); None: no metrics.
        api_key: require `Authorization: Bearer <api_key>` on every route but /health, /metrics.
        model_root: the checkpoint path shown as `root` in /v1/models.
        max_request_body_bytes: larger request bodies get 413.
        tool_call_parser, enable_auto_tool_choice, reasoning_parser,
            trust_request_chat_template: see `ServingChat`.
        lora_modules, allow_runtime_lora_updating: LoRA adapters served from the start, and
            whether /v1/load_lora_adapter and /v1/unload_lora_adapter exist (serving_lora.py).
        dev_mode: add the development routes (dev_routes.py: sleep mode, pause, weight
            updates); None: as `PAGEDLLM_SERVER_DEV_MODE` says. With data parallelism they are
            not added (logged).
        media_fetcher: fetches image URLs of chat requests (multimodal/fetch.py); None: only
            data: URLs.

    Raises:
        ValueError: a `lora_modules` adapter the engine refuses (its reason).
    """
    serving = OpenAIServing(async_llm, served_model_names)
    if lora_modules or allow_runtime_lora_updating:
        serving.lora_modules = LoRAModules(async_llm, served_model_names)
        for module in lora_modules:
            try:
                serving.lora_modules.load(module.name, module.path, module.base_model_name)
            except OpenAIServingError as e:
                raise ValueError(f"--lora-modules {module.name}: {e.message}") from None
    completions = ServingCompletion(serving)
    chats = ServingChat(serving, tool_call_parser=tool_call_parser,
                        enable_auto_tool_choice=enable_auto_tool_choice,
                        reasoning_parser=reasoning_parser,
                        trust_request_chat_template=trust_request_chat_template,
                        media_fetcher=media_fetcher)
    responses = ServingResponses(chats)
    messages = ServingMessages(chats)

    def render_chat(request: TokenizeRequest) -> list[int]:
        # NOTE(api_server): the chat handler's own checks and rendering, so /tokenize counts
        # exactly the prompt /v1/chat/completions would run for these messages and tools.
        chat_request = ChatCompletionRequest.model_construct(
            messages=request.messages, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=request.tools, chat_template_kwargs=request.chat_template_kwargs)
        try:
            chat_request.check_supported()
        except ValueError as e:
            raise error_from_exception(e, request) from e
        return chats.render_prompt(chat_request)
    tokenization = ServingTokenization(
        serving.tokenizer, async_llm.vocab_size, async_llm.max_model_len,
        async_llm.input_processor.max_prompt_chars(async_llm.max_model_len),
        serving.check_model, render_chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_llm.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_llm.shutdown)

    app = FastAPI(title="pagedllm OpenAI-compatible server", lifespan=lifespan)
    install_auth_and_error_handlers(app, api_key, max_request_body_bytes)
    app.add_middleware(AnthropicErrorMiddleware)     # outermost: also the 401 and 413 answers

    @app.get("/health")
    async def health() -> Response:
        if async_llm.dead_error is not None:
            return _error_response(OpenAIServingError(str(async_llm.dead_error), 503,
                                                      code="engine_dead"))
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        models = model_list(serving.served_model_names, model_root, async_llm.max_model_len)
        if serving.lora_modules is not None:
            models.data += serving.lora_modules.cards(async_llm.max_model_len)
        return JSONResponse(models.model_dump())

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return _respond(await _cancel_on_disconnect(request, completions.create_completion(body)),
                        body.request_id)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return _respond(await _cancel_on_disconnect(request, chats.create_chat_completion(body)),
                        body.request_id)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return _respond(await _cancel_on_disconnect(request, responses.create_response(body)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve_response(response_id))

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return _respond(await _cancel_on_disconnect(request, messages.create_message(body)))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> JSONResponse:
        return JSONResponse(messages.count_tokens(body).model_dump())

    add_tokenization_routes(app, tokenization)
    if allow_runtime_lora_updating:
        add_lora_routes(app, serving.lora_modules)

    if dev_mode if dev_mode is not None else envs.get("PAGEDLLM_SERVER_DEV_MODE"):
        if isinstance(async_llm, AsyncLLM):
            add_dev_routes(app, async_llm)
        else:
            logger.warning("PAGEDLLM_SERVER_DEV_MODE: the development routes are not served "
                           "with data parallelism")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        num_blocks = await async_llm.reset_prefix_cache()
        return JSONResponse({"num_uncached_blocks": num_blocks})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    return app


def run_server(model: str, engine_kwargs: dict[str, Any], host: str = "127.0.0.1",
               port: int = 8000, api_key: str | None = None,
               served_model_names: Sequence[str] | None = None,
               log_level: str = "info", runner: str = "auto",
               data_parallel_size: int = 1,
               data_parallel_routing_policy: str = "prefix_aware",
               multiprocess_mode: bool = False,
               data_parallel_backend: str = "mp",
               data_parallel_address: str | None = None,
               max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
               tool_call_parser: str | None = None,
               enable_auto_tool_choice: bool = False,
               trust_request_chat_template: bool = False,
               lora_modules: Sequence[LoRAModulePath] = (),
               allow_runtime_lora_updating: bool = False,
               media_fetcher: MediaFetcher | None = None,
               core_launchers: Sequence[Any] | None = None,
               sockets: Sequence[Any] | None = None) -> int:
    """Load the model, then serve until SIGINT/SIGTERM or until the engine dies.

    Returns the process exit status: 0 after a signal, 1 if the engine died (so a supervisor
    restarts the server).

    Args:
        model: checkpoint folder or hub id.
        engine_kwargs: engine arguments (vLLM names) for `LLMEngine.from_engine_args`.
        served_model_names: names clients use; default `[model]` (serving_models.py has the
            rule).
        runner: "generate", "pooling" (serve /v1/embeddings, see embedding_server.py) or
            "auto" (pooling for architectures without an LM head).
        data_parallel_size: engine replicas behind this server (see engine/dp_async_llm.py).
        data_parallel_routing_policy: how a request picks its replica (engine/dp_router.py).
        multiprocess_mode: each engine core in its own process (engine/core_client.py).
        data_parallel_backend, data_parallel_address: "ray": each replica's core a Ray actor
            (engine/core_ray.py; implies multiprocess_mode), see
            `DataParallelAsyncLLM.from_engine_args`.
        max_request_body_bytes: larger request bodies get 413.
        tool_call_parser, enable_auto_tool_choice, trust_request_chat_template: see
            `ServingChat` (the reasoning parser is the engine argument `reasoning_parser`).
        lora_modules, allow_runtime_lora_updating, media_fetcher: see `build_app`.
        core_launchers: engine cores started elsewhere, one `core_client.CoreLauncher` per
            replica (an API server of the pool, api_server_pool.py); overrides
            data_parallel_size and the backend.
        sockets: listening sockets to serve on instead of binding host:port (the pool's).

    Raises:
        ValueError, FileNotFoundError: invalid engine arguments or a missing model (before any
            port is bound).
    """
    from pagedllm.engine.pooling_engine import PoolingEngine, is_pooling_model

    init_logger()
    names = resolve_served_model_names(model, served_model_names)
    if runner == "auto":
        runner = "pooling" if is_pooling_model(model, engine_kwargs.get("revision")) \
            else "generate"
    async_llm = None
    if runner == "pooling" and data_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 is not supported with --runner pooling")
    if runner == "pooling" and multiprocess_mode:
        raise ValueError("--multiprocess-mode is not supported with --runner pooling")
    if runner == "pooling":
        from pagedllm.entrypoints.openai.embedding_server import build_embedding_app
        app = build_embedding_app(PoolingEngine.from_engine_args(model, **engine_kwargs), names,
                                  api_key=api_key, model_root=model,
                                  max_request_body_bytes=max_request_body_bytes)
    else:
        from pagedllm.entrypoints.chat_template_check import (has_chat_template,
                                                              no_chat_template_message)
        if has_chat_template(model, engine_kwargs.get("tokenizer"),
                             engine_kwargs.get("chat_template")) is False:
            logger.warning("%s; /v1/chat/completions will answer 400, completions work",
                           no_chat_template_message(model))
        metrics = PrometheusStatLogger(names[0])
        if multiprocess_mode:
            engine_kwargs = {**engine_kwargs, "multiprocess_mode": True}
        if core_launchers is not None:
            engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "multiprocess_mode"}
            async_llm = DataParallelAsyncLLM.from_engine_args(
                model, len(core_launchers), stat_loggers=lambda i: [metrics.for_engine(i)],
                routing_policy=data_parallel_routing_policy, core_launchers=core_launchers,
                **engine_kwargs) if len(core_launchers) > 1 else AsyncLLM.from_engine_args(
                model, stat_loggers=[metrics], multiprocess_mode=core_launchers[0],
                **engine_kwargs)
        elif data_parallel_size > 1 or data_parallel_backend == "ray":
            async_llm = DataParallelAsyncLLM.from_engine_args(
                model, data_parallel_size, stat_loggers=lambda i: [metrics.for_engine(i)],
                routing_policy=data_parallel_routing_policy,
                data_parallel_backend=data_parallel_backend,
                data_parallel_address=data_parallel_address, **engine_kwargs)
        else:
            async_llm = AsyncLLM.from_engine_args(model, stat_loggers=[metrics],
                                                  **engine_kwargs)
        app = build_app(async_llm, names, metrics=metrics, api_key=api_key, model_root=model,
                        max_request_body_bytes=max_request_body_bytes,
                        tool_call_parser=tool_call_parser,
                        enable_auto_tool_choice=enable_auto_tool_choice,
                        reasoning_parser=engine_kwargs.get("reasoning_parser"),
                        trust_request_chat_template=trust_request_chat_template,
                        lora_modules=lora_modules,
                        allow_runtime_lora_updating=allow_runtime_lora_updating,
                        media_fetcher=media_fetcher)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config, async_llm.shutdown if async_llm is not None else None)
    engine_died: list[BaseException] = []
    if async_llm is not None:
        def stop_serving(error: BaseException) -> None:
            logger.error("the engine died (%s): failing pending requests and shutting down", error)
            engine_died.append(error)
            server.should_exit = True
        async_llm.on_dead(stop_serving)
    logger.info("serving %s as %s on http://%s:%d", model, names, host, port)
    previous = {sig: signal.signal(sig, _exit_after_graceful_shutdown)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=list(sockets) if sockets is not None else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if async_llm is not None:
            async_llm.shutdown()
    return 1 if engine_died else 0


class _Server(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown ends with the engine's: one second before the
    grace period runs out, `stop_engine` (blocking, run in a thread) fails the requests still
    open, whose handlers then answer with OpenAI's error object (503, "the engine was shut
    down") instead of being cancelled by uvicorn (a plain-text 500 and a traceback)."""

    def __init__(self, config: uvicorn.Config, stop_engine: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._stop_engine = stop_engine

    async def shutdown(self, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        timer = None
        if self._stop_engine is not None:
            stop = self._stop_engine
            timer = loop.call_later(max(0.0, GRACEFUL_SHUTDOWN_S - 1.0),
                                    lambda: loop.run_in_executor(None, stop))
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def _exit_after_graceful_shutdown(signum: int, frame: Any) -> None:
    # NOTE(api_server): uvicorn catches SIGINT/SIGTERM itself, shuts down gracefully (lifespan
    # included, which stops the engine thread), then restores the previous handlers and re-raises
    # the signal. This handler is that "previous" one, so the process then exits with status 0
    # instead of dying of the signal a second time.
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    from pagedllm.entrypoints.cli_parser import CLIArgumentParser
    from pagedllm.entrypoints.openai.cli_args import add_serve_args, run_serve

    parser = CLIArgumentParser(prog="pagedllm-api-server", description="OpenAI-compatible server")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
