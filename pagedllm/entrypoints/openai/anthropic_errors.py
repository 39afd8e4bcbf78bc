"""Anthropic's error shape on the Messages routes (`/v1/messages...`).

Anthropic's clients expect `{"type": "error", "error": {"type": ..., "message": ...}}` and pick
the exception class from the HTTP status (400 BadRequestError, 401 AuthenticationError, ...). The
errors of these routes come from the server's shared layers (API key and body-size middleware,
request validation, the serving checks), which write OpenAI's error object; rather than teach
each of them about the route, `AnthropicErrorMiddleware` rewrites that object at the edge, for
these paths only. `param` (the request field at fault) is kept as an extra key of `error`.
"""

from __future__ import annotations

import json
from typing import Any

ANTHROPIC_PATH_PREFIX = "/v1/messages"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status (5xx other than 529: "api_error")."""
    error_type = _ERROR_TYPES.get(status_code,
                                  "api_error" if status_code >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"type": error_type, "message": message}
    if param is not None:
        error["param"] = param
    return {"type": "error", "error": error}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


class AnthropicErrorMiddleware:
    """Pure ASGI middleware: on the Messages routes, an error answer (status >= 400) carrying
    OpenAI's error object is sent as Anthropic's instead. Other answers pass untouched (streams
    included: only error answers, which are small JSON bodies, are buffered)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_anthropic_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def rewrite(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            payload = _translate(start["status"], b"".join(body))
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(payload)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
        await self.app(scope, receive, rewrite)


def _translate(status_code: int, raw: bytes) -> bytes:
    try:
        error = json.loads(raw)["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        return raw      # not OpenAI's error object (e.g. an empty 499): sent as it is
    return json.dumps(anthropic_error(status_code, message, param)).encode()
