"""POST /v1/chat/completions: messages -> chat template -> one engine request, whole or streamed.

The conversation (and the request's `tools`) is rendered and tokenized by the tokenizer's own
chat template (`apply_chat_template(..., add_generation_prompt=...)`, the call `LLM.chat` makes),
so a served chat gives the same tokens as an offline one. Each choice's text is read into
reasoning, content and tool calls by `chat_output.ChoiceOutputParser` (tool modes in
tool_choice.py). Streaming: a first chunk with the assistant role, then `reasoning_content`,
`content` and `tool_calls` deltas, a chunk with finish_reason, an optional usage chunk, then
`data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.chat_output import NO_TOOLS, ChoiceOutputParser, ToolMode
from pagedllm.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatLogprobs, ChatResponseMessage,
                                                  ChatStreamChoice, CompletionTokensDetails,
                                                  FunctionCallOutput, PromptLogprob,
                                                  TokenLogprob, ToolCall, TopLogprob, UsageInfo,
                                                  now_s)
from pagedllm.entrypoints.openai.serving_beam_search import FinishedStream, beam_search
from pagedllm.multimodal.fetch import MediaFetcher
from pagedllm.entrypoints.openai.serving_images import has_image_parts, render_image_chat
from pagedllm.entrypoints.openai.template_thread import RequestTemplateRenderer
from pagedllm.entrypoints.openai.tool_choice import template_messages, template_tools
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagedllm.engine.async_llm import RequestStream
from pagedllm.engine.logprob_strings import TokenBytes
from pagedllm.reasoning import ReasoningParser, get_reasoning_parser
from pagedllm.reasoning.budget import ThinkingBudgetLogitsProcessor
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing,
                                                        OpenAIServingError, SSEChunkFrame,
                                                        SSEStream, chat_choice_json,
                                                        clamp_logprob, error_from_exception,
                                                        final_outputs, sse_event, token_string,
                                                        usage_of, usage_so_far)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger(__name__)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int, token_bytes: TokenBytes | None = None,
                  as_token_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat logprobs for generated tokens.

    `token`: the token's text in context (`Logprob.decoded_token`: "" for a token that completes no
    character yet), or "token_id:<id>" with `as_token_ids` (vLLM's return_tokens_as_token_ids);
    `bytes`: the token's own raw bytes (`TokenBytes`; without it the UTF-8 of the text), so the
    chosen tokens' bytes join to the UTF-8 of the text."""
    def entry_of(token_id: int, lp: Logprob, cls: type[TopLogprob], **extra) -> TopLogprob:
        text = lp.decoded_token or ""
        raw = token_bytes.get(token_id, text) if token_bytes is not None else text.encode()
        return cls(token=token_string(token_id, text, as_token_ids),
                   logprob=clamp_logprob(lp.logprob), bytes=list(raw), **extra)

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None
                         and lp.rank <= num_top), key=lambda item: item[1].rank)
        top = [entry_of(tid, lp, TopLogprob) for tid, lp in ranked]
        content.append(entry_of(token_id, entry[token_id], TokenLogprob, top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs_of(output: RequestOutput, as_token_ids: bool
                       ) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of a chat response: per prompt token {token id: entry}."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(tid): PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                decoded_token=token_string(tid, lp.decoded_token or "",
                                                           as_token_ids))
        for tid, lp in entry.items()} for entry in output.prompt_logprobs]


@dataclass
class AdmittedChat:
    """A queued chat request: the model name to report, how its output is read for tool calls,
    its engine stream (the caller closes it) and its prompt length in tokens."""

    model: str
    mode: ToolMode
    stream: RequestStream | FinishedStream
    num_prompt_tokens: int


class ServingChat:
    """Handler of the chat completions endpoint.

    Args:
        serving: the shared checks and engine handle.
        tool_call_parser: the format `tool_choice: "auto"` reads calls in (`tool_parsers/`).
        enable_auto_tool_choice: allow `tool_choice: "auto"` (needs `tool_call_parser`).
        reasoning_parser: split `reasoning_content` off the output (`pagedllm/reasoning`).
        trust_request_chat_template: allow a request's own `chat_template` (vLLM's
            --trust-request-chat-template; a template is code the server runs).
        media_fetcher: fetches `http(s)://` and `file:` image URLs under its SSRF rules
            (multimodal/fetch.py); None: such URLs are refused.

    Raises:
        ValueError: an unknown parser name, or auto tool choice without a parser.
    """

    def __init__(self, serving: OpenAIServing, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None,
                 trust_request_chat_template: bool = False,
                 media_fetcher: MediaFetcher | None = None) -> None:
        self.serving = serving
        self.media_fetcher = media_fetcher
        self.trust_request_chat_template = trust_request_chat_template
        self._template_renderer = RequestTemplateRenderer()
        self._token_bytes: TokenBytes | None = None
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.tool_parser: ToolParser | None = (get_tool_parser(tool_call_parser)
                                               if tool_call_parser else None)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning: ReasoningParser | None = (get_reasoning_parser(reasoning_parser)
                                                  if reasoning_parser else None)
        self._marker_ids: tuple[int, int] | None = None

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | SSEStream:
        """A response object, or (stream=True) the SSE stream.

        Raises:
            OpenAIServingError: for an invalid request (before any byte is sent), a request that
                failed alone (500) or a dead engine (503).
        """
        response_id, engine_id = self.serving.request_ids(request, "chatcmpl")
        created = now_s()
        chat = await self.admit_chat(request, engine_id)
        if request.stream:
            return SSEStream(self._stream(request, chat.mode, chat.stream,
                                          chat.num_prompt_tokens, response_id, created,
                                          chat.model), [chat.stream])
        [final] = await final_outputs([chat.stream], request)
        choices = [self._choice(request, chat.mode, c)
                   for c in sorted(final.outputs, key=lambda c: c.index)]
        return ChatCompletionResponse(
            id=response_id, created=created, model=chat.model, usage=self.usage(final),
            choices=choices,
            prompt_logprobs=prompt_logprobs_of(final, request.return_tokens_as_token_ids),
            kv_transfer_params=final.kv_transfer_params)

    async def admit_chat(self, request: ChatCompletionRequest, request_id: str) -> AdmittedChat:
        """Check, render and queue a chat request as engine request `request_id` (or run its
        beam search): the whole admission of `create_chat_completion`, for handlers that
        present the output in another API's shape (serving_responses.py, serving_messages.py).

        Raises:
            OpenAIServingError: 400 naming the field, 404 for an unknown model, 503 for a dead
                engine; nothing stays queued then.
        """
        model = self.serving.check_request(request, "top_logprobs")
        mode = self._tool_mode(request)
        mm_features: list = []
        if has_image_parts(request):
            rendered, mm_features = await render_image_chat(
                request, self.serving.async_llm.input_processor.mm_processor,
                self.media_fetcher)
        else:
            rendered = await self._render(request)
        token_ids, params = self.serving.prepare(
            request, self.serving.check_token_ids(rendered, param="messages"))
        if mm_features and (request.use_beam_search or len(token_ids) != len(rendered)):
            raise OpenAIServingError("messages: a prompt with images cannot be truncated or "
                                     "beam searched", 400, param="messages")
        if mode.parser is not None and mode.parser.needs_special_tokens:
            params.skip_special_tokens = False      # the parser must see its markers
        if request.prompt_logprobs is not None:
            self.serving.check_logprobs_count(request.prompt_logprobs, "prompt_logprobs")
            params.prompt_logprobs = request.prompt_logprobs
        if request.thinking_token_budget is not None:
            params.logits_processors = [*(params.logits_processors or ()),
                                        self._thinking_budget(request.thinking_token_budget)]
        if request.use_beam_search:
            [final] = await beam_search(self.serving, request, [token_ids], params.max_tokens,
                                        request_id)
            return AdmittedChat(model, mode, FinishedStream(final), len(token_ids))
        prompt = {"prompt_token_ids": token_ids}
        if mm_features:
            prompt["mm_features"] = mm_features
        [stream] = await self.serving.admit(request, [(prompt, params)],
                                            request_id)
        return AdmittedChat(model, mode, stream, len(token_ids))

    def _choice(self, request: ChatCompletionRequest, mode: ToolMode,
                completion: CompletionOutput) -> ChatChoice:
        parser = ChoiceOutputParser(mode, self.reasoning)
        out = parser.result(completion.text)
        tool_calls = [ToolCall(id=call_id, function=FunctionCallOutput(
            name=call.name, arguments=call.arguments))
            for call_id, call in zip(parser.call_ids(len(out.tool_calls)), out.tool_calls)]
        message = ChatResponseMessage(content=out.content, reasoning_content=out.reasoning,
                                      tool_calls=tool_calls)
        return ChatChoice(index=completion.index, message=message,
                          logprobs=self._logprobs(request, completion, 0),
                          finish_reason=parser.finish_reason(out, completion.finish_reason),
                          stop_reason=completion.stop_reason)

    def usage(self, final: RequestOutput) -> UsageInfo:
        """The request's usage; with a reasoning parser also the reasoning tokens
        (`completion_tokens_details.reasoning_tokens`, OpenAI's field)."""
        usage = usage_of([final])
        if self.reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(
                self.reasoning.num_reasoning_tokens(list(c.token_ids), self._markers())
                for c in final.outputs))
        return usage

    def _markers(self) -> tuple[int, int]:
        """The reasoning markers' token ids (read once)."""
        if self._marker_ids is None:
            self._marker_ids = self.reasoning.marker_token_ids(self.serving.tokenizer)
        return self._marker_ids

    def _thinking_budget(self, budget: int) -> ThinkingBudgetLogitsProcessor:
        """The processor enforcing `thinking_token_budget`. Raises OpenAIServingError 400 on a
        server without a reasoning parser (nothing says where the reasoning ends)."""
        if self.reasoning is None:
            raise OpenAIServingError("thinking_token_budget needs the server started with "
                                     "--reasoning-parser (it names the reasoning's end marker)",
                                     400, param="thinking_token_budget")
        start, end = self._markers()
        return ThinkingBudgetLogitsProcessor(budget, start, end, self.reasoning.implicit_start)

    def _tool_mode(self, request: ChatCompletionRequest) -> ToolMode:
        """How the request's output is read for tool calls. Raises OpenAIServingError 400 for
        `tool_choice: "auto"` on a server started without auto tool choice."""
        kind = request.effective_tool_choice()
        if kind == "none":
            return NO_TOOLS
        if kind == "auto":
            if not self.enable_auto_tool_choice:
                raise OpenAIServingError(
                    '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                    'and --tool-call-parser; send tool_choice "required", a named function or '
                    '"none"', 400, param="tool_choice")
            return ToolMode("auto", parser=self.tool_parser,
                            parallel=request.parallel_tool_calls)
        if kind == "named":
            return ToolMode("named", function=request.tool_choice.function.name)
        return ToolMode("required", parallel=request.parallel_tool_calls)

    async def _stream(self, request: ChatCompletionRequest, mode: ToolMode,
                      stream: RequestStream, num_prompt_tokens: int, response_id: str,
                      created: int, model: str) -> AsyncIterator[str]:
        options = request.stream_options
        sent_tokens = [0] * request.n
        parsers = [ChoiceOutputParser(mode, self.reasoning) for _ in range(request.n)]

        frame = SSEChunkFrame(ChatCompletionChunk(id=response_id, created=created, model=model,
                                                  choices=[]))
        continuous_usage = options is not None and options.continuous_usage_stats

        def chunk(index: int, delta: dict[str, Any], logprobs: ChatLogprobs | None = None,
                  finish_reason: str | None = None, stop_reason: int | str | None = None) -> str:
            if logprobs is None and not continuous_usage:
                # The common case, serialized without pydantic models (SSEChunkFrame).
                return frame.event(chat_choice_json(index, delta, finish_reason, stop_reason))
            usage = None
            if continuous_usage:
                usage = usage_so_far(num_prompt_tokens, sent_tokens[index])
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=stop_reason)
            return sse_event(ChatCompletionChunk(id=response_id, created=created, model=model,
                                                 choices=[choice], usage=usage))
        done = [False] * request.n
        final: RequestOutput | None = None
        try:
            for index in range(request.n):
                yield chunk(index, {"role": "assistant", "content": ""})
            async for out in stream:
                final = out
                for c in out.outputs:
                    if done[c.index]:
                        continue
                    parser = parsers[c.index]
                    done[c.index] = c.finish_reason is not None
                    deltas = parser.deltas(c.text, final=done[c.index])
                    logprobs = self._logprobs(request, c, sent_tokens[c.index])
                    if logprobs is not None and not logprobs.content:
                        logprobs = None
                    sent_tokens[c.index] = len(c.token_ids)
                    if not deltas and (done[c.index] or logprobs is not None):
                        deltas = [{"content": ""}]
                    finish_reason = (parser.finish_reason(parser.result(c.text), c.finish_reason)
                                     if done[c.index] else None)
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        yield chunk(c.index, delta, logprobs if i == 0 else None,
                                    finish_reason if last else None,
                                    c.stop_reason if last else None)
            if options is not None and options.include_usage:
                yield sse_event(ChatCompletionChunk(id=response_id, created=created, model=model,
                                                    choices=[], usage=self.usage(final)))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            error = error_from_exception(e, request)
            logger.warning("chat stream %s failed: %s", response_id, error.message)
            yield sse_event(error.to_response())
        yield SSE_DONE

    def _logprobs(self, request: ChatCompletionRequest, completion: CompletionOutput,
                  start: int) -> ChatLogprobs | None:
        if not request.logprobs or completion.logprobs is None:
            return None
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.serving.tokenizer)
        return chat_logprobs(completion.token_ids[start:], completion.logprobs[start:],
                             request.top_logprobs or 0, self._token_bytes,
                             request.return_tokens_as_token_ids)

    async def _render(self, request: ChatCompletionRequest) -> list[int]:
        """`render_prompt`; with the request's own chat template, off the event loop and
        bounded in time (template_thread.py)."""
        if request.chat_template is None:
            return self.render_prompt(request)
        if not self.trust_request_chat_template:
            raise OpenAIServingError("chat_template: a request's own chat template needs the "
                                     "server started with --trust-request-chat-template", 400,
                                     param="chat_template")
        return await self._template_renderer.render(lambda: self.render_prompt(request))

    def render_prompt(self, request: ChatCompletionRequest) -> list[int]:
        """Token ids of the templated conversation. Raises OpenAIServingError 400."""
        tokenizer = self.serving.tokenizer
        if not request.messages:
            raise OpenAIServingError("messages must not be empty", 400, param="messages")
        if not (request.chat_template or getattr(tokenizer, "chat_template", None)):
            raise OpenAIServingError("the model's tokenizer has no chat template (start the "
                                     "server with --chat-template FILE)", 400, param="messages")
        try:
            conversation = template_messages(request)
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, param="messages") from e
        tools = template_tools(request)
        limit = self.serving.async_llm.input_processor.max_prompt_chars(self.serving.max_model_len)
        num_chars = sum(len(m["content"]) for m in conversation)
        if num_chars > limit:                    # refused before the template even runs
            raise OpenAIServingError(f"messages: {num_chars} characters cannot fit max_model_len "
                                     f"({self.serving.max_model_len}) tokens", 400,
                                     param="messages")
        try:
            # NOTE(serving_chat): rendered to text, measured, then tokenized as
            # apply_chat_template(tokenize=True) does (no special tokens added): the tools are
            # only counted if the template renders them.
            text = tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False, chat_template=request.chat_template,
                **request.template_kwargs())
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIServingError(f"could not render the messages with the chat template: "
                                     f"{e}", 400, param="messages") from e
        if not isinstance(text, str):
            raise OpenAIServingError("the chat template did not render text (check "
                                     "chat_template_kwargs)", 400, param="chat_template_kwargs")
        if len(text) > limit:
            raise OpenAIServingError(
                f"the rendered conversation ({len(text)} characters"
                f"{', tools included' if tools else ''}) cannot fit max_model_len "
                f"({self.serving.max_model_len}) tokens", 400,
                param="tools" if tools and num_chars + len(json.dumps(tools)) > limit
                else "messages")
        return tokenizer.encode(text, add_special_tokens=False)
