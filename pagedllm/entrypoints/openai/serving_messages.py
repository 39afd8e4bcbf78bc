"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat pipeline.

A Messages request is translated into a `ChatCompletionRequest` (`to_chat_request`) and runs
through `ServingChat.admit_chat`, so validation, the chat template, tool calling (tool_choice.py,
chat_output.py, tool_parsers/) and admission are the chat endpoint's own. Mapping:

    system                      -> a first "system" message
    text blocks                 -> the turn's content (joined with newlines)
    tool_use blocks (assistant) -> the assistant message's tool_calls
    tool_result blocks (user)   -> "tool" messages (tool_call_id = tool_use_id), in block order
    tools[].input_schema        -> function parameters
    tool_choice auto|any|tool|none -> "auto" | "required" | named function | "none";
                                  disable_parallel_tool_use -> parallel_tool_calls: false
    output_config.format        -> response_format {"type": "json_schema", ...}
    thinking enabled + budget_tokens -> thinking_token_budget (needs --reasoning-parser)
    a final assistant turn (prefill) -> continue_final_message (the answer continues it)
    stop_sequences -> stop; max_tokens, temperature, top_p, top_k as they are

The output is read by `ChoiceOutputParser` and presented as Anthropic content blocks (thinking,
text, tool_use), whole or as Anthropic's event stream (message_start, content_block_start/delta/
stop, message_delta with stop_reason and usage, message_stop; an `error` event if the request
fails after the stream began).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.anthropic_errors import anthropic_error
from pagedllm.entrypoints.openai.chat_output import ChoiceOutputParser, ToolMode
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_anthropic import (AnthropicMessage, AnthropicUsage,
                                                            ContentBlock, CountTokensRequest,
                                                            CountTokensResponse, MessageParam,
                                                            MessagesRequest, TextBlock,
                                                            TextBlockParam, ThinkingBlock,
                                                            ToolChoiceAny, ToolChoiceNone,
                                                            ToolChoiceTool, ToolResultBlockParam,
                                                            ToolUseBlock, ToolUseBlockParam,
                                                            MessagesInput)
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_engine import (OpenAIServingError, SSEStream,
                                                        error_from_exception, final_outputs)
from pagedllm.engine.async_llm import RequestStream
from pagedllm.outputs import CompletionOutput

logger = logging.getLogger(__name__)

# Chat request fields an error may name -> the Messages field a client sent (None: none).
_PARAM_NAMES: dict[str, str | None] = {
    "stop": "stop_sequences", "max_completion_tokens": "max_tokens", "prompt": "messages",
    "parallel_tool_calls": "tool_choice", "structured_outputs": "output_config",
    "response_format": "output_config", "chat_template_kwargs": "messages"}


def _param(name: str | None) -> str | None:
    if name is None or name in MessagesRequest.model_fields:
        return name
    return _PARAM_NAMES.get(name)


def _renamed(error: OpenAIServingError) -> OpenAIServingError:
    """The chat pipeline's error with `param` named as the Messages request names it."""
    error.param = _param(error.param)
    return error


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _stop_reason(completion: CompletionOutput, tool_use: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished completion."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):       # a matched stop string
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object `tool_use.input` needs; None if they are not one (a
    forced call cut by max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _chat_messages(request: MessagesInput) -> list[dict[str, Any]]:
    """The conversation as chat messages (see the module docstring).

    Raises:
        ValueError: a block in a turn whose role cannot carry it, or a final assistant turn
            with tool calls (nothing to continue).
    """
    chat: list[dict[str, Any]] = []
    system = request.system_text()
    if system is not None:
        chat.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        chat.extend(_chat_turn(i, message))
    if request.messages and request.messages[-1].role == "assistant" \
            and chat[-1].get("tool_calls"):
        raise ValueError("messages: a final assistant turn (prefill) must be text; its tool_use "
                         "blocks need a user turn with their tool_result after them")
    return chat


def _chat_turn(index: int, message: MessageParam) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    where = f"messages[{index}]"
    if message.role == "assistant":
        texts, calls = [], []
        for block in message.content:
            if isinstance(block, TextBlockParam):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlockParam):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlockParam):
                raise ValueError(f"{where}: tool_result blocks belong in user turns")
        turn: dict[str, Any] = {"role": "assistant",
                                "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    turns: list[dict[str, Any]] = []
    texts = []
    for block in message.content:
        if isinstance(block, ToolResultBlockParam):
            if texts:
                turns.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id,
                          "content": block.text()})
        elif isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            raise ValueError(f"{where}: tool_use blocks belong in assistant turns")
        else:
            raise ValueError(f"{where}: thinking blocks belong in assistant turns")
    if texts or not turns:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _chat_tool_fields(request: MessagesInput) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {}),
            **({"strict": tool.strict} if tool.strict is not None else {})}}
            for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        if isinstance(choice, ToolChoiceNone):
            fields["tool_choice"] = "none"
        elif isinstance(choice, ToolChoiceTool):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else "auto"
        if getattr(choice, "disable_parallel_tool_use", None):
            fields["parallel_tool_calls"] = False
    return fields


def _sse(event: str, payload: dict[str, Any]) -> str:
    """One event of Anthropic's stream: its name on `event:` and the JSON on `data:`."""
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n"


class _BlockEvents:
    """Turns the chat deltas of one streamed choice (`ChoiceOutputParser.deltas`) into Anthropic
    content block events: a block is started when the kind of delta changes (thinking, text, a
    new tool call) and stopped before the next one starts."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.index += 1
        self.open = kind
        return events + [_sse("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                            "delta": delta})

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def events(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if "reasoning_content" in delta:
            if self.open != "thinking":
                events += self._start("thinking", ThinkingBlock(thinking="").model_dump())
            events.append(self._delta({"type": "thinking_delta",
                                       "thinking": delta["reasoning_content"]}))
        if "content" in delta:
            if self.open != "text":
                events += self._start("text", TextBlock(text="").model_dump())
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            if "id" in call:
                events += self._start("tool_use", {"type": "tool_use", "id": call["id"],
                                                   "name": function["name"], "input": {}})
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": function["arguments"]}))
        return events


class ServingMessages:
    """Handler of Anthropic's Messages endpoints, over the chat endpoint's handler.

    Args:
        chats: the server's chat handler (its parsers, template rendering and admission).
    """

    def __init__(self, chats: ServingChat) -> None:
        self.chats = chats

    def to_chat_request(self, request: MessagesInput) -> ChatCompletionRequest:
        """The chat request that renders and samples as `request` asks.

        Raises:
            OpenAIServingError: 400 naming the Messages field for what cannot be translated
                (a block in the wrong turn, prefill, a `thinking` setting).
        """
        budget = self._thinking_budget(request)
        try:
            fields: dict[str, Any] = {"model": request.model,
                                      "messages": _chat_messages(request),
                                      **_chat_tool_fields(request)}
            if request.messages and request.messages[-1].role == "assistant":
                fields.update(continue_final_message=True, add_generation_prompt=False)
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, param="messages") from e
        config = request.output_config
        if config is not None and config.effort is not None:
            raise OpenAIServingError("output_config: effort is not supported (this server has no "
                                     "effort control)", 400, param="output_config")
        if config is not None and config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": config.format.schema_}}
        if budget is not None:
            fields["thinking_token_budget"] = budget
        if isinstance(request, MessagesRequest):
            fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences,
                          temperature=request.temperature, top_p=request.top_p,
                          top_k=request.top_k)
        try:
            chat_request = ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            first = e.errors()[0]
            loc = [str(part) for part in first["loc"]]
            raise OpenAIServingError(f"invalid request: {'.'.join(loc)}: {first['msg']}", 400,
                                     param=_param(loc[0] if loc else None)) from e
        try:
            chat_request.check_supported()
        except ValueError as e:
            raise _renamed(error_from_exception(e, chat_request)) from e
        return chat_request

    def _thinking_budget(self, request: MessagesInput) -> int | None:
        """The reasoning budget of `"enabled"` thinking (`budget_tokens`, enforced as chat's
        thinking_token_budget); None for no budget. Raises OpenAIServingError 400 (param
        thinking) for a setting this server cannot honour: a budget without a reasoning parser
        or on another type, "between_tools", hidden thinking, or "disabled" on a model that
        reasons anyway (--reasoning-parser)."""
        thinking = request.thinking
        if thinking is None:
            return None
        problem = None
        if thinking.type == "enabled" and thinking.budget_tokens is None:
            problem = '"enabled" needs budget_tokens'
        elif thinking.type == "enabled" and self.chats.reasoning is None:
            problem = ('"enabled" cannot be honoured: this server has no --reasoning-parser, so '
                       'nothing says where the model\'s thinking ends')
        elif thinking.type == "between_tools" or (thinking.budget_tokens is not None
                                                  and thinking.type != "enabled"):
            problem = (f'"{thinking.type}" with a budget cannot be honoured; send '
                       '{"type": "enabled", "budget_tokens": N} or {"type": "adaptive"}')
        elif thinking.display == "omitted":
            problem = 'display "omitted" is not supported (thinking is returned as it is)'
        elif thinking.type == "disabled" and self.chats.reasoning is not None:
            problem = ('"disabled" cannot be honoured: this server\'s model reasons before it '
                       'answers (--reasoning-parser); leave thinking out')
        if problem is not None:
            raise OpenAIServingError(f"thinking: {problem}", 400, param="thinking")
        return thinking.budget_tokens

    async def create_message(self, request: MessagesRequest) -> AnthropicMessage | SSEStream:
        """The message, or (stream: true) Anthropic's event stream.

        Raises:
            OpenAIServingError: 400 naming the field (before any byte is sent), 404 for an
                unknown model, 500 for a request that failed alone, 503 for a dead engine.
        """
        chat_request = self.to_chat_request(request)
        if chat_request.effective_tool_choice() == "auto" and \
                not self.chats.enable_auto_tool_choice:
            raise OpenAIServingError(
                'tool_choice "auto" (the default with tools) needs the server started with '
                '--enable-auto-tool-choice and --tool-call-parser; send tool_choice {"type": '
                '"any"}, {"type": "tool", "name": ...} or {"type": "none"}', 400,
                param="tool_choice")
        message_id = _message_id()
        try:
            chat = await self.chats.admit_chat(chat_request, message_id)
        except OpenAIServingError as e:
            raise _renamed(e) from e
        if request.stream:
            return SSEStream(self._stream(chat_request, chat.mode, chat.stream,
                                          chat.num_prompt_tokens, message_id, chat.model),
                             [chat.stream])
        [final] = await final_outputs([chat.stream], chat_request)
        [completion] = final.outputs
        content, tool_use = self._content(chat.mode, completion.text)
        stop_reason, stop_sequence = _stop_reason(completion, tool_use)
        return AnthropicMessage(
            id=message_id, model=chat.model, content=content, stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=AnthropicUsage(input_tokens=len(final.prompt_token_ids),
                                 output_tokens=len(completion.token_ids),
                                 cache_read_input_tokens=final.num_cached_tokens))

    def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """`input_tokens`: the length of the prompt /v1/messages would run (the chat template's
        rendering of system, messages and tools).

        Raises:
            OpenAIServingError: 400 naming the field, 404 for an unknown model.
        """
        chat_request = self.to_chat_request(request)
        try:
            self.chats.serving.check_model(chat_request.model)
            return CountTokensResponse(input_tokens=len(self.chats.render_prompt(chat_request)))
        except OpenAIServingError as e:
            raise _renamed(e) from e

    def _content(self, mode: ToolMode, text: str) -> tuple[list[ContentBlock], bool]:
        """The content blocks of a whole output, and whether it holds a tool call."""
        parser = ChoiceOutputParser(mode, self.chats.reasoning)
        out = parser.result(text)
        blocks: list[ContentBlock] = []
        if out.reasoning:
            blocks.append(ThinkingBlock(thinking=out.reasoning))
        texts = [out.content] if out.content else []
        calls = []
        for call_id, call in zip(parser.call_ids(len(out.tool_calls)), out.tool_calls):
            arguments = _tool_input(call.arguments)
            if arguments is None:
                texts.append(call.arguments)    # not a whole call: shown as the text it is
            else:
                calls.append(ToolUseBlock(id=call_id, name=call.name, input=arguments))
        if texts:
            blocks.append(TextBlock(text="".join(texts)))
        return blocks + calls, bool(calls)

    async def _stream(self, chat_request: ChatCompletionRequest, mode: ToolMode,
                      stream: RequestStream, num_prompt_tokens: int, message_id: str,
                      model: str) -> AsyncIterator[str]:
        start = AnthropicMessage(id=message_id, model=model, content=[],
                                 usage=AnthropicUsage(input_tokens=num_prompt_tokens,
                                                      output_tokens=0))
        yield _sse("message_start", {"type": "message_start", "message": start.model_dump()})
        parser = ChoiceOutputParser(mode, self.chats.reasoning)
        blocks = _BlockEvents()
        try:
            async for out in stream:
                [completion] = out.outputs
                done = completion.finish_reason is not None
                for delta in parser.deltas(completion.text, final=done):
                    for event in blocks.events(delta):
                        yield event
                if not done:
                    continue
                for event in blocks.stop():
                    yield event
                tool_use = any(_tool_input(call.arguments) is not None
                               for call in parser.result(completion.text).tool_calls)
                stop_reason, stop_sequence = _stop_reason(completion, tool_use)
                yield _sse("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": len(completion.token_ids),
                              "cache_read_input_tokens": out.num_cached_tokens}})
                yield _sse("message_stop", {"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            error = _renamed(error_from_exception(e, chat_request))
            logger.warning("messages stream %s failed: %s", message_id, error.message)
            yield _sse("error", anthropic_error(error.status_code, error.message, error.param))
