"""`pagedllm proxy --prefill URL --decode URL --port P`: the front door of a prefill/decode pair
(docs/kv_connectors.md), vLLM's toy proxy protocol:

    client ── POST /v1/completions ──► proxy ── same body, max_tokens=1, stream=false,
                                          │      kv_transfer_params {"do_remote_decode": true}
                                          │      ──► prefill (kv_producer): computes the prompt,
                                          │          answers with kv_transfer_params
                                          └────► decode (kv_consumer): the client's body plus
           ◄── the decode instance's answer,            those kv_transfer_params; loads the
               streamed or not, relayed as is           prompt's KV, generates

/v1/chat/completions works the same; /v1/models is the decode instance's; /health is healthy
when both are. An error of the prefill instance is returned as it is (its status and body); a
prefill answer without kv_transfer_params (e.g. the prompt ended at its first token) sends the
request to the decode instance alone, which then computes the prompt itself.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# What the prefill instance is sent in place of the client's generation limits.
_PREFILL_OVERRIDES = {"max_tokens": 1, "stream": False,
                      "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                             "remote_engine_id": None, "remote_block_ids": None,
                                             "remote_host": None, "remote_port": None}}
# Client fields the prefill instance must not get (a one-token answer cannot honour them).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "max_completion_tokens")
# Request headers passed on to both instances.
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def prefill_body(body: dict) -> dict:
    """The client's request as the prefill instance gets it."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(_PREFILL_OVERRIDES)
    return out


def build_app(prefill_url: str, decode_url: str, timeout: float = 600.0):
    """The proxy's FastAPI app for one prefill and one decode instance (base URLs such as
    http://127.0.0.1:8100)."""
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pagedllm prefill/decode proxy", lifespan=lifespan)

    def error(message: str, status: int) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "proxy_error",
                                       "code": status}}, status_code=status)

    def relay(response: httpx.Response) -> Response:
        return Response(response.content, response.status_code,
                        media_type=response.headers.get("content-type"))

    async def generate(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error("the request body is not JSON", 400)
        if not isinstance(body, dict):
            return error("the request body must be a JSON object", 400)
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        try:
            first = await client.post(prefill_url + path, json=prefill_body(body),
                                      headers=headers)
        except httpx.HTTPError as e:
            return error(f"the prefill instance {prefill_url} failed: {e!r}", 502)
        if first.status_code != 200:
            return relay(first)
        params = first.json().get("kv_transfer_params")
        decode = dict(body)
        if params is not None:
            decode["kv_transfer_params"] = params
        try:
            if not body.get("stream"):
                return relay(await client.post(decode_url + path, json=decode,
                                               headers=headers))
            upstream = await client.send(client.build_request(
                "POST", decode_url + path, json=decode, headers=headers), stream=True)
        except httpx.HTTPError as e:
            return error(f"the decode instance {decode_url} failed: {e!r}", 502)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
        return StreamingResponse(chunks(), upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return relay(await client.get(decode_url + "/v1/models", headers={
                k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}))
        except httpx.HTTPError as e:
            return error(f"the decode instance {decode_url} failed: {e!r}", 502)

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return error(f"{url} is not healthy", 503)
            except httpx.HTTPError:
                return error(f"{url} does not answer", 503)
        return Response(status_code=200)

    return app


def add_proxy_parser(subparsers) -> None:
    """Register `pagedllm proxy` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "proxy", help="the front door of a prefill/decode pair (P2pShmConnector; vLLM's toy "
                      "proxy protocol, docs/kv_connectors.md)")
    p.add_argument("--prefill", required=True, metavar="URL",
                   help="the prefill instance (kv_producer), e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL",
                   help="the decode instance (kv_consumer), e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for either instance's answer")
    p.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted.

    Raises:
        ValueError: a URL that is not http(s)://.
    """
    import uvicorn
    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{name} must be an http(s):// URL, got {url!r}")
    uvicorn.run(build_app(args.prefill, args.decode, args.timeout), host=args.host,
                port=args.port, log_level="warning")
    return 0
