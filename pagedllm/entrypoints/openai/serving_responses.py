"""POST /v1/responses (OpenAI's Responses API) over the chat pipeline; GET /v1/responses/{id}.

A Responses request is translated into a `ChatCompletionRequest` - `instructions` and the input
items become chat messages (a `function_call` item an assistant tool call, a
`function_call_output` item a tool message), `tools`/`tool_choice` the chat tool fields,
`text.format` the `response_format`, `max_output_tokens` the `max_completion_tokens` - which
`ServingChat.admit_chat` checks, renders with the chat template and queues exactly as
/v1/chat/completions does. A 400 from that path names the Responses field (`_RESPONSES_PARAM`).
The output text is read by the same `ChoiceOutputParser` (reasoning, content, tool calls) and
turned into output items and stream events by `ResponseOutputBuilder`. With `store: true` the
answer and its conversation go to the in-memory `ResponseStore`, which `previous_response_id`
continues (instructions are not carried over, as in OpenAI's API).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.openai.chat_output import ChoiceOutputParser, ToolMode
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, now_s, random_id
from pagedllm.entrypoints.openai.protocol_responses import (
    FunctionCallItem, FunctionCallOutputItem, IncompleteDetails, InputItem, InputTokensDetails,
    MessageItem, NamedToolChoice, OutputTokensDetails, ResponsesRequest, ResponsesResponse,
    ResponseUsage)
from pagedllm.entrypoints.openai.responses_output import ResponseOutputBuilder
from pagedllm.entrypoints.openai.responses_store import ResponseStore
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_engine import (OpenAIServingError, SSEStream,
                                                        error_from_exception, final_outputs)
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

_INPUT_ITEMS = TypeAdapter(list[InputItem])
# The Responses field a chat request's field comes from (for the `param` of an error); chat
# fields of the same name map to themselves, others to None.
_RESPONSES_PARAM = {"messages": "input", "chat_template_kwargs": "input",
                    "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                    "response_format": "text", "structured_outputs": "text"}


def responses_param(chat_param: str | None) -> str | None:
    """The Responses request field that a chat request's field `chat_param` was made from."""
    if chat_param is None:
        return None
    name = _RESPONSES_PARAM.get(chat_param, chat_param)
    return name if name in ResponsesRequest.model_fields else None


def chat_messages(instructions: str | None, items: list[Any], first: int = 0
                  ) -> list[dict[str, Any]]:
    """The chat messages of a conversation: `instructions` as a system message, then the items
    in order (function calls join the assistant message before them, else form one; reasoning
    items are left out). `first`: the index of the request's own first item (for errors).

    Raises:
        ValueError: a `function_call_output` whose `call_id` no earlier `function_call` has.
    """
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise ValueError(f"input[{i - first}]: function_call_output {item.call_id!r} "
                                 f"answers no function_call of the conversation")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "name": names[item.call_id], "content": item.text()})
    return messages


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]
                 ) -> ChatCompletionRequest:
    """The chat request that generates the answer of `request` over `messages`.

    Raises:
        OpenAIServingError: 400 naming the Responses field (a value the chat request refuses).
    """
    body: dict[str, Any] = {"messages": messages, "parallel_tool_calls":
                            request.parallel_tool_calls}
    for name in ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "seed"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    if request.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in request.tools]
    if isinstance(request.tool_choice, NamedToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            by_alias=True, exclude={"type"}, exclude_none=True)}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        raise OpenAIServingError(f"invalid request: {first.get('msg')}", 400,
                                 param=responses_param(loc[0] if loc else None)) from e


def as_responses_error(e: Exception, request: ChatCompletionRequest) -> OpenAIServingError:
    """`e` (from the chat path) as an error whose `param` names the Responses field."""
    error = error_from_exception(e, request)
    return OpenAIServingError(error.message, error.status_code, param=responses_param(
        error.param), code=error.code)


class ServingResponses:
    """Handler of the Responses endpoints.

    Args:
        chats: the chat handler whose checks, template rendering, tool modes and reasoning
            parser the answers go through.
        store: where `store: true` responses are kept (default: `ResponseStore()`'s caps).
    """

    def __init__(self, chats: ServingChat, store: ResponseStore | None = None) -> None:
        self.chats = chats
        self.store = store if store is not None else ResponseStore()

    async def create_response(self, request: ResponsesRequest
                              ) -> ResponsesResponse | SSEStream:
        """A Response object, or (stream=True) the SSE stream of Responses events.

        Raises:
            OpenAIServingError: 400 naming the field for an invalid request, 404 for an unknown
                model or a `previous_response_id` that is not stored (never stored, evicted or
                expired), 500/503 as for chat.
        """
        try:
            request.check_supported()
        except ValueError as e:
            raise error_from_exception(e, request) from e
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise OpenAIServingError(
                    f"previous response {request.previous_response_id!r} is not stored here "
                    f"(it was created without store: true, or was evicted or expired)", 404,
                    param="previous_response_id")
            history = stored.conversation
        own = ([{"type": "message", "role": "user", "content": request.input}]
               if isinstance(request.input, str)
               else [item.model_dump(exclude_none=True) for item in request.input])
        conversation = history + own
        try:
            messages = chat_messages(request.instructions,
                                     _INPUT_ITEMS.validate_python(conversation), len(history))
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, param="input") from e
        chat = chat_request(request, messages)
        response_id, created = random_id("resp"), now_s()
        try:
            admitted = await self.chats.admit_chat(chat, response_id)
        except OpenAIServingError as e:
            raise as_responses_error(e, chat) from e
        answer = _Answer(request, response_id, created, admitted.model, conversation)
        if request.stream:
            return SSEStream(self._stream(answer, chat, admitted.mode, admitted.stream),
                             [admitted.stream])
        try:
            [final] = await final_outputs([admitted.stream], chat)
        except OpenAIServingError as e:
            raise as_responses_error(e, chat) from e
        builder = ResponseOutputBuilder()
        builder.feed(ChoiceOutputParser(admitted.mode, self.chats.reasoning).deltas(
            final.outputs[0].text, final=True))
        builder.finish(incomplete=_cut(final))
        return self._finish(answer, builder, final)

    def retrieve_response(self, response_id: str) -> dict[str, Any]:
        """A stored Response object. Raises OpenAIServingError 404 if it is not stored."""
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIServingError(f"response {response_id!r} is not stored here (created "
                                     f"without store: true, or evicted or expired)", 404,
                                     param="response_id")
        return stored.response

    def _finish(self, answer: _Answer, builder: ResponseOutputBuilder,
                final: RequestOutput) -> ResponsesResponse:
        """The finished Response (stored when asked)."""
        usage = self.chats.usage(final)
        response = answer.response(
            "incomplete" if _cut(final) else "completed",
            builder, ResponseUsage(
                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=usage.prompt_tokens_details.cached_tokens),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=(
                    usage.completion_tokens_details.reasoning_tokens
                    if usage.completion_tokens_details is not None else 0))))
        if answer.request.store:
            dumped = response.model_dump()
            if not self.store.put(dumped, answer.conversation + dumped["output"]):
                logger.warning("response %s is larger than the response store's cap; not "
                               "stored", response.id)
        return response

    async def _stream(self, answer: _Answer, chat: ChatCompletionRequest, mode: ToolMode,
                      stream: RequestStream) -> AsyncIterator[str]:
        builder = ResponseOutputBuilder()
        parser = ChoiceOutputParser(mode, self.chats.reasoning)
        started = answer.response("in_progress", builder).model_dump()
        try:
            yield _sse(builder.event("response.created", response=started))
            yield _sse(builder.event("response.in_progress", response=started))
            final: RequestOutput | None = None
            async for out in stream:
                final = out
                completion = out.outputs[0]
                for event in builder.feed(parser.deltas(
                        completion.text, final=completion.finish_reason is not None)):
                    yield _sse(event)
            for event in builder.finish(incomplete=_cut(final)):
                yield _sse(event)
            response = self._finish(answer, builder, final)
            yield _sse(builder.event("response.completed", response=response.model_dump()))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            error = as_responses_error(e, chat)
            logger.warning("responses stream %s failed: %s", answer.response_id, error.message)
            yield _sse(builder.event("error", code=error.code, message=error.message,
                                     param=error.param))


def _cut(final: RequestOutput) -> bool:
    """Whether the answer was cut by its token cap (the Response is "incomplete")."""
    return final.outputs[0].finish_reason == "length"


@dataclass(frozen=True)
class _Answer:
    """One answer's request, identity, and conversation (earlier turns, then its input items),
    from which its Response objects are made."""

    request: ResponsesRequest
    response_id: str
    created: int
    model: str
    conversation: list[dict[str, Any]]

    def response(self, status: str, builder: ResponseOutputBuilder,
                 usage: ResponseUsage | None = None) -> ResponsesResponse:
        """The Response object: the request's settings echoed, `builder`'s items (none while
        "in_progress") and `usage`."""
        request = self.request
        kind = request.effective_tool_choice()
        return ResponsesResponse(
            id=self.response_id, created_at=self.created, model=self.model, status=status,
            output=list(builder.items) if status != "in_progress" else [],
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {}, parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            temperature=request.temperature, top_p=request.top_p,
            tool_choice=request.tool_choice.model_dump() if kind == "named" else kind,
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            text=(request.text.model_dump(by_alias=True, exclude_none=True)
                  if request.text is not None and request.text.format is not None
                  else {"format": {"type": "text"}}),
            reasoning=(request.reasoning.model_dump() if request.reasoning is not None
                       else None),
            store=request.store, usage=usage, user=request.user)


def _sse(event: dict[str, Any]) -> str:
    """One Responses stream event (named by an `event:` line, as OpenAI sends them)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
