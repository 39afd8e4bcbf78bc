"""What completions and chat share: model-name checks, prompt limits, sampling params, errors, SSE.

`OpenAIServing` is composed into `ServingCompletion` and `ServingChat` (no subclassing). Everything
that can be wrong with a request is raised as `OpenAIServingError` before the request reaches the
engine, so one bad request never disturbs the others.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, UsageInfo
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

_LEADING_NAME = re.compile(r"^([a-z_]+)\b")


class OpenAIServingError(Exception):
    """An error answered with OpenAI's error object.

    Args:
        message: human-readable reason.
        status_code: HTTP status (400 bad request, 401, 404 unknown model, 500, 503).
        param: the offending request field, if known.
        code: OpenAI's machine-readable code (e.g. "model_not_found"), if any.
    """

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param, self.code = message, status_code, param, code

    @property
    def error_type(self) -> str:
        if self.status_code == 401:
            return "authentication_error"
        if self.status_code == 404:
            return "not_found_error"
        return "invalid_request_error" if self.status_code < 500 else "server_error"

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.error_type,
                                             param=self.param, code=self.code))


def error_from_exception(e: BaseException, fields: Sequence[str] = ()) -> OpenAIServingError:
    """Map an engine exception to an HTTP error (ValueError -> 400 naming the field if it can)."""
    if isinstance(e, OpenAIServingError):
        return e
    if isinstance(e, ValueError):
        match = _LEADING_NAME.match(str(e))
        param = match.group(1) if match and match.group(1) in fields else None
        return OpenAIServingError(str(e), 400, param=param)
    if isinstance(e, EngineDeadError):
        return OpenAIServingError(str(e), 503, code="engine_dead")
    return OpenAIServingError(f"internal error: {type(e).__name__}: {e}", 500)


def sse_event(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event (`data: ...` + blank line)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# JSON has no -inf: very unlikely tokens are reported at this floor, as vLLM does.
MIN_LOGPROB = -9999.0
# The most alternatives per token a request may ask for (OpenAI allows 20 in chat).
MAX_TOP_LOGPROBS = 20


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def usage_of(outputs: Sequence[RequestOutput]) -> UsageInfo:
    """Token counts of finished requests (each prompt counted once, every sequence's output)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


async def merge_async_iterators(iterators: Sequence[AsyncIterator[Any]]
                                ) -> AsyncIterator[tuple[int, Any]]:
    """Yield (index, item) from several async iterators as items arrive.

    Closing the merged iterator (or an exception in one input) cancels the other inputs, which
    runs their cleanup (for `AsyncLLM.generate`: aborting the request).
    """
    if len(iterators) == 1:
        async with aclosing(iterators[0]):
            async for item in iterators[0]:
                yield 0, item
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncIterator[Any]) -> None:
        try:
            async for item in iterator:
                await merged.put((index, item))
            await merged.put((index, done))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await merged.put((index, e))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    """Request checks shared by the endpoints.

    Args:
        async_llm: the running engine.
        served_model_names: names a request's `model` may use; the first is reported back.
    """

    def __init__(self, async_llm: AsyncLLM, served_model_names: Sequence[str]) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.async_llm = async_llm
        self.tokenizer = async_llm.tokenizer
        self.max_model_len = async_llm.max_model_len
        self.served_model_names = list(served_model_names)

    def check_model(self, model: str | None) -> str:
        """The model name to report. Raises OpenAIServingError 404 for an unknown name."""
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        raise OpenAIServingError(f"The model `{model}` does not exist.", 404, param="model",
                                 code="model_not_found")

    def check_logprobs(self, request: Any, param: str) -> None:
        """Raises OpenAIServingError 400 if more than MAX_TOP_LOGPROBS alternatives are asked."""
        num = request.num_logprobs()
        if num is not None and not 0 <= num <= MAX_TOP_LOGPROBS:
            raise OpenAIServingError(f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {num}",
                                     400, param=param)

    def sampling_params(self, request: Any, num_prompt_tokens: int) -> SamplingParams:
        """SamplingParams for one prompt of `request`, with the context-length check.

        Raises:
            OpenAIServingError: 400 if prompt + max_tokens exceeds max_model_len, or for any
                out-of-range sampling field (param names the field).
        """
        max_tokens = request.requested_max_tokens()
        param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) \
            is not None else "max_tokens"
        if num_prompt_tokens >= self.max_model_len or (
                max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len):
            requested = num_prompt_tokens + (max_tokens or 0)
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{max_tokens or 0} for the completion). Please reduce the length of the "
                f"prompt or the completion.", 400,
                param=param if num_prompt_tokens < self.max_model_len else None)
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
        try:
            return request.to_sampling_params(max_tokens)
        except ValueError as e:
            raise error_from_exception(e, list(type(request).model_fields)) from e

    def tokenize(self, text: str) -> list[int]:
        # NOTE(serving): the same call the engine's InputProcessor makes, so a text prompt gives the
        # same ids here and offline; done on the event loop (fast tokenizers take microseconds).
        return list(self.tokenizer(text).input_ids)

    def check_token_ids(self, token_ids: list[int]) -> list[int]:
        """Raises OpenAIServingError 400 for an empty prompt or ids outside the vocabulary."""
        if not token_ids:
            raise OpenAIServingError("the prompt is empty (no tokens)", 400, param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.async_llm.vocab_size]
        if bad:
            raise OpenAIServingError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.async_llm.vocab_size})", 400, param="prompt")
        return token_ids
