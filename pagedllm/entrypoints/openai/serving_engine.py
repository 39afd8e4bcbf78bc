"""What completions and chat share: model-name checks, prompt limits, sampling params, errors, SSE.

`OpenAIServing` is composed into `ServingCompletion` and `ServingChat` (no subclassing). Everything
that can be wrong with a request is raised as `OpenAIServingError` (a 4xx whose `param` names the
field) before any byte of the response is sent: `admit` runs the engine's admission gate
(`AsyncLLM.add_request`) for every prompt of a request before a handler returns, streaming or not,
so one bad request never disturbs the others and never gets a 200 followed by an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_json

from pagedllm.engine.async_llm import (AsyncLLM, EngineDeadError, RequestFailedError,
                                       RequestStream)
from pagedllm.engine.input_processor import PromptType, context_length_error
from pagedllm.engine.sleep_mode import EngineSleepingError
from pagedllm.entrypoints.openai.protocol import (ErrorInfo, ErrorResponse, PromptTokensDetails,
                                                  UsageInfo, random_id)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

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


def error_from_exception(e: BaseException, request: Any = None) -> OpenAIServingError:
    """Map an engine exception to an HTTP error: ValueError -> 400 whose `param` is the request
    field the message starts with (engine names mapped to the request's own), a request that
    failed alone in a step -> 500, a dead or sleeping engine -> 503."""
    if isinstance(e, OpenAIServingError):
        return e
    if isinstance(e, ValueError):
        match = _LEADING_NAME.match(str(e))
        return OpenAIServingError(str(e), 400, param=request_param(
            match.group(1) if match else None, request))
    if isinstance(e, RequestFailedError):
        return OpenAIServingError(f"the request failed: {e}", 500, code="request_failed")
    if isinstance(e, EngineDeadError):
        return OpenAIServingError(str(e), 503, code="engine_dead")
    if isinstance(e, EngineSleepingError):
        return OpenAIServingError(str(e), 503, code="engine_sleeping")
    return OpenAIServingError(f"internal error: {type(e).__name__}: {e}", 500)


def request_param(name: str | None, request: Any) -> str | None:
    """The request field an engine-side field name refers to, or None."""
    if name is None or request is None:
        return None
    if name == "structured_outputs":
        return request.structured_outputs_field()
    if name == "prompt" and "messages" in type(request).model_fields:
        return "messages"
    if name == "logprobs" and "top_logprobs" in type(request).model_fields:
        return "top_logprobs"
    if name == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return name if name in type(request).model_fields else None


def sse_event(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event (`data: ...` + blank line)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEChunkFrame:
    """A stream's chunk object serialized once around its `choices` list, so that each event
    serializes only its choices: `event(choices_json)` equals `sse_event(chunk)` for the chunk
    with those choices (pydantic's own JSON: same field order, no spaces).

    Streaming sends one event per token and request; building and dumping the whole pydantic
    chunk each time was most of the per-token cost of the streaming code itself (~37 us against
    ~4 us, measured in docs/benchmarks.md "Serving speed").

    Args:
        chunk: the stream's chunk model with `choices=[]` and every other field as each event
            carries it (id, created, model; usage None).

    Raises:
        ValueError: `chunk` does not serialize with an empty `"choices":[]`.
    """

    _MARK = '"choices":[]'

    def __init__(self, chunk: BaseModel) -> None:
        text = chunk.model_dump_json()
        if text.count(self._MARK) != 1:
            raise ValueError(f"SSEChunkFrame: {type(chunk).__name__} has no empty choices list")
        head, _, tail = text.partition(self._MARK)
        self._head = f'data: {head}"choices":['
        self._tail = f"]{tail}\n\n"

    def event(self, choices_json: str) -> str:
        """The SSE event of the chunk whose `choices` serialize to `[choices_json]`."""
        return f"{self._head}{choices_json}{self._tail}"


def chat_choice_json(index: int, delta: dict[str, Any], finish_reason: str | None = None,
                     stop_reason: int | str | None = None) -> str:
    """`ChatStreamChoice(index=..., delta=..., finish_reason=..., stop_reason=...)`'s
    `model_dump_json()` (no logprobs; `delta` plain JSON data), without building the model (see
    SSEChunkFrame)."""
    return to_json({"index": index, "delta": delta, "logprobs": None,
                    "finish_reason": finish_reason, "stop_reason": stop_reason}).decode()


def text_choice_json(index: int, text: str, finish_reason: str | None,
                     stop_reason: int | str | None) -> str:
    """`CompletionChoice(index=..., text=..., finish_reason=..., stop_reason=...)`'s
    `model_dump_json()` (no logprobs), without building the model (see SSEChunkFrame)."""
    return (f'{{"index":{index},"text":{to_json(text).decode()},"logprobs":null,'
            f'"finish_reason":{to_json(finish_reason).decode()},'
            f'"stop_reason":{to_json(stop_reason).decode()}}}')


@dataclass
class SSEStream:
    """A streamed answer: its SSE lines and the engine streams behind them.

    The server closes `streams` however the response ends (finished, client gone, or never
    started), which aborts whatever is still running.
    """

    events: AsyncIterator[str]
    streams: list[RequestStream]

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


# JSON has no -inf: very unlikely tokens are reported at this floor, as vLLM does.
MIN_LOGPROB = -9999.0
# The most alternatives per token a request may ask for (OpenAI allows 20 in chat).
MAX_TOP_LOGPROBS = 20


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_string(token_id: int, text: str, as_token_id: bool) -> str:
    """A token as logprobs show it: its text, or "token_id:<id>" (vLLM's
    return_tokens_as_token_ids, for tokens whose text is not JSON-friendly)."""
    return f"token_id:{token_id}" if as_token_id else text


def usage_of(outputs: Sequence[RequestOutput]) -> UsageInfo:
    """Token counts of finished requests (each prompt counted once, every sequence's output)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def usage_so_far(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    """Usage of one streamed choice so far (`stream_options.continuous_usage_stats`)."""
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens)


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


async def final_outputs(streams: Sequence[Any], request: Any) -> list[RequestOutput]:
    """The last output of each of a non-streamed request's engine streams (`RequestStream`s, or
    anything iterable and closable alike), gathered as they finish; every stream is closed
    however this ends.

    Raises:
        OpenAIServingError: a request failed (500) or the engine died (503).
    """
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(merge_async_iterators(streams)) as merged:
            async for index, out in merged:
                finals[index] = out
    except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
        raise error_from_exception(e, request) from e
    finally:
        for stream in streams:
            stream.close()
    return finals


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
        # The LoRA adapters a request's `model` may name (serving_lora.py; None: LoRA off).
        self.lora_modules = None
        # The model's sampling defaults for fields a request leaves out (read once at start).
        self.default_sampling_params: dict[str, Any] = dict(async_llm.default_sampling_params)
        if self.default_sampling_params:
            logger.info("Using default sampling params from model generation config: %s "
                        "(--generation-config vllm ignores them)", self.default_sampling_params)

    def check_model(self, model: str | None) -> str:
        """The model name to report. Raises OpenAIServingError 404 for an unknown name."""
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        if self.lora_modules is not None and model in self.lora_modules.adapters:
            return model
        raise OpenAIServingError(f"The model `{model}` does not exist.", 404, param="model",
                                 code="model_not_found")

    def check_logprobs(self, request: Any, param: str) -> None:
        """Raises OpenAIServingError 400 if more alternatives are asked than the engine's
        max_logprobs allows (20 by default, OpenAI's limit)."""
        self.check_logprobs_count(request.num_logprobs(), param)

    def check_logprobs_count(self, num: int | None, param: str) -> None:
        """Raises OpenAIServingError 400 naming `param` unless `num` (alternatives per token;
        None = none asked) is within [0, max_logprobs]."""
        limit = self.async_llm.input_processor.limits.max_logprobs
        if limit < 0:
            limit = self.async_llm.vocab_size
        if num is not None and not 0 <= num <= limit:
            raise OpenAIServingError(f"{param} must be in [0, {limit}], got {num}", 400,
                                     param=param)

    def check_request(self, request: Any, logprobs_param: str) -> str:
        """The checks every request passes first: fields this server cannot honour, the model
        name and the logprobs cap. Returns the model name to report.

        Raises:
            OpenAIServingError: 400 naming the field, or 404 for an unknown model.
        """
        try:
            request.check_supported()
        except ValueError as e:
            raise error_from_exception(e, request) from e
        model = self.check_model(request.model)
        self.check_logprobs(request, logprobs_param)
        return model

    @staticmethod
    def request_ids(request: Any, prefix: str) -> tuple[str, str]:
        """(response id, engine request id) of a request: "<prefix>-<request_id>" for a request
        that names itself (vLLM's `request_id`), else a random one. The engine id stays unique
        (random) even when two requests send the same `request_id`."""
        engine_id = random_id(prefix)
        if request.request_id is None:
            return engine_id, engine_id
        return f"{prefix}-{request.request_id}", engine_id

    def prepare(self, request: Any, token_ids: list[int]) -> tuple[list[int], SamplingParams]:
        """Validate the sampling fields, truncate the prompt (`truncate_prompt_tokens`) and check
        the context length. Returns (prompt token ids, SamplingParams).

        Fields the request leaves out take the model's defaults (`default_sampling_params`),
        else the built-in ones. The output cap is the request's, else the model's
        max_new_tokens (cut to what the context leaves, as vLLM does), else the endpoint's
        built-in cap, else the rest of the context.

        Raises:
            OpenAIServingError: 400 if prompt + max_tokens exceeds max_model_len, or for any
                out-of-range sampling field (param names the field).
        """
        max_tokens = request.requested_max_tokens()
        model_max_tokens = self.default_sampling_params.get("max_tokens") \
            if max_tokens is None else None
        if max_tokens is None and model_max_tokens is None:
            max_tokens = request.builtin_max_tokens()
        try:
            params = request.to_sampling_params(max_tokens, self.default_sampling_params)
        except ValueError as e:
            raise error_from_exception(e, request) from e
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        num_prompt_tokens = len(token_ids)
        param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) \
            is not None else "max_tokens"
        too_long = context_length_error(self.max_model_len, num_prompt_tokens, max_tokens)
        if too_long is not None:
            raise OpenAIServingError(
                too_long, 400,
                param=param if num_prompt_tokens < self.max_model_len else
                ("messages" if "messages" in type(request).model_fields else "prompt"))
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - num_prompt_tokens
            if model_max_tokens is not None:
                params.max_tokens = min(params.max_tokens, model_max_tokens)
        return token_ids, params

    async def admit(self, request: Any, prompts: Sequence[tuple[PromptType, SamplingParams]],
                    request_id: str) -> list[RequestStream]:
        """Queue every prompt of `request` ("{request_id}-{i}"), all or none, at the request's
        `priority` (0 for a request type without one).

        Raises:
            OpenAIServingError: 400 naming the field for a request the engine refuses (nothing
                stays queued), 503 if the engine is dead.
        """
        streams: list[RequestStream] = []
        lora_modules, model = self.lora_modules, getattr(request, "model", None)
        try:
            for i, (prompt, params) in enumerate(prompts):
                req_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                lora = lora_modules.acquire(model) if lora_modules is not None else None
                try:
                    stream = await self.async_llm.add_request(
                        req_id, prompt, params, lora_request=lora,
                        priority=getattr(request, "priority", 0))
                except BaseException:
                    if lora is not None:
                        lora_modules.release(model)
                    raise
                if lora is not None:
                    stream.add_close_callback(lambda *_: lora_modules.release(model))
                streams.append(stream)
        except BaseException as e:
            for stream in streams:
                stream.close()
            if isinstance(e, Exception):
                raise error_from_exception(e, request) from e
            raise
        return streams

    def tokenize(self, text: str, request: Any) -> list[int]:
        """The ids of a text prompt, by the engine's own `InputProcessor.tokenize` (the same
        ids as offline), which refuses a text too long for max_model_len before tokenizing it.

        Raises:
            OpenAIServingError: 400 naming `prompt` for a text that cannot fit.
        """
        # NOTE(serving): done on the event loop: fast tokenizers take microseconds for any text
        # that can fit, and longer ones are refused by their length first.
        truncate = request.truncate_prompt_tokens
        if not (isinstance(truncate, int) and 0 < truncate <= self.max_model_len):
            truncate = None  # an invalid value is refused by `prepare`
        try:
            return self.async_llm.input_processor.tokenize(text, truncate)
        except ValueError as e:
            raise error_from_exception(e, request) from e

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        """Raises OpenAIServingError 400 (naming `param`) for an empty prompt or ids outside
        the vocabulary."""
        if not token_ids:
            raise OpenAIServingError("the prompt is empty (no tokens)", 400, param=param)
        bad = [t for t in token_ids if not 0 <= t < self.async_llm.vocab_size]
        if bad:
            raise OpenAIServingError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.async_llm.vocab_size})", 400, param=param)
        return token_ids
