"""POST /v1/chat/completions: messages -> chat template -> one engine request, whole or streamed.

The conversation is rendered and tokenized by the tokenizer's own chat template
(`apply_chat_template(..., add_generation_prompt=...)`, the call `LLM.chat` makes), so a served
chat gives the same tokens as an offline one. Streaming: a first chunk with the assistant role,
content deltas, a chunk with finish_reason, an optional usage chunk, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from pagedllm.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatLogprobs, ChatResponseMessage,
                                                  ChatStreamChoice, TokenLogprob, TopLogprob,
                                                  now_s, random_id)
from pagedllm.engine.async_llm import RequestStream
from pagedllm.engine.logprob_strings import TokenBytes
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing,
                                                        OpenAIServingError, SSEStream,
                                                        clamp_logprob, error_from_exception,
                                                        sse_event, usage_of, usage_so_far)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger(__name__)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int, token_bytes: TokenBytes | None = None) -> ChatLogprobs:
    """OpenAI's chat logprobs for generated tokens.

    `token`: the token's text in context (`Logprob.decoded_token`: "" for a token that completes no
    character yet); `bytes`: the token's own raw bytes (`TokenBytes`; without it the UTF-8 of the
    string), so the chosen tokens' bytes join to the UTF-8 of the text."""
    def raw(token_id: int, text: str) -> list[int]:
        return list(token_bytes.get(token_id, text) if token_bytes is not None
                    else text.encode())

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None
                         and lp.rank <= num_top), key=lambda item: item[1].rank)
        top = [TopLogprob(token=lp.decoded_token or "", logprob=clamp_logprob(lp.logprob),
                          bytes=raw(tid, lp.decoded_token or "")) for tid, lp in ranked]
        token = chosen.decoded_token or ""
        content.append(TokenLogprob(token=token, logprob=clamp_logprob(chosen.logprob),
                                    bytes=raw(token_id, token), top_logprobs=top))
    return ChatLogprobs(content=content)


class ServingChat:
    """Handler of the chat completions endpoint.

    Args:
        serving: the shared checks and engine handle.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self._token_bytes: TokenBytes | None = None

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | SSEStream:
        """A response object, or (stream=True) the SSE stream.

        Raises:
            OpenAIServingError: for an invalid request (before any byte is sent), a request that
                failed alone (500) or a dead engine (503).
        """
        model = self.serving.check_request(request, "top_logprobs")
        token_ids, params = self.serving.prepare(
            request, self.serving.check_token_ids(self._render(request), param="messages"))
        response_id, created = random_id("chatcmpl"), now_s()
        [stream] = await self.serving.admit(request, [({"prompt_token_ids": token_ids}, params)],
                                            response_id)
        if request.stream:
            return SSEStream(self._stream(request, stream, len(token_ids), response_id, created,
                                          model), [stream])
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            raise error_from_exception(e, request) from e
        finally:
            stream.close()
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(request, c, 0),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in sorted(final.outputs, key=lambda c: c.index)]
        return ChatCompletionResponse(id=response_id, created=created, model=model,
                                      usage=usage_of([final]), choices=choices)

    async def _stream(self, request: ChatCompletionRequest, stream: RequestStream,
                      num_prompt_tokens: int, response_id: str, created: int,
                      model: str) -> AsyncIterator[str]:
        options = request.stream_options
        sent_chars, sent_tokens = [0] * request.n, [0] * request.n

        def chunk(choice: ChatStreamChoice) -> str:
            usage = None
            if options is not None and options.continuous_usage_stats:
                usage = usage_so_far(num_prompt_tokens, sent_tokens[choice.index])
            return sse_event(ChatCompletionChunk(id=response_id, created=created, model=model,
                                                 choices=[choice], usage=usage))
        done = [False] * request.n
        final: RequestOutput | None = None
        try:
            for index in range(request.n):
                yield chunk(ChatStreamChoice(index=index,
                                             delta={"role": "assistant", "content": ""}))
            async for out in stream:
                final = out
                for c in out.outputs:
                    if done[c.index]:
                        continue
                    delta = c.text[sent_chars[c.index]:]
                    logprobs = self._logprobs(request, c, sent_tokens[c.index])
                    if logprobs is not None and not logprobs.content:
                        logprobs = None
                    sent_chars[c.index] += len(delta)
                    sent_tokens[c.index] = len(c.token_ids)
                    done[c.index] = c.finish_reason is not None
                    if delta or done[c.index] or logprobs is not None:
                        yield chunk(ChatStreamChoice(
                            index=c.index, delta={"content": delta}, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            if options is not None and options.include_usage:
                yield sse_event(ChatCompletionChunk(id=response_id, created=created, model=model,
                                                    choices=[], usage=usage_of([final])))
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
                             request.top_logprobs or 0, self._token_bytes)

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        """Token ids of the templated conversation. Raises OpenAIServingError 400."""
        tokenizer = self.serving.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise OpenAIServingError("the model's tokenizer has no chat template", 400,
                                     param="messages")
        if not request.messages:
            raise OpenAIServingError("messages must not be empty", 400, param="messages")
        try:
            conversation = [{"role": m.role, "content": m.text_content()}
                            for m in request.messages]
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, param="messages") from e
        num_chars = sum(len(m["content"]) for m in conversation)
        limit = self.serving.async_llm.input_processor.max_prompt_chars(self.serving.max_model_len)
        if num_chars > limit:
            raise OpenAIServingError(f"messages: {num_chars} characters cannot fit max_model_len "
                                     f"({self.serving.max_model_len}) tokens", 400,
                                     param="messages")
        try:
            return list(tokenizer.apply_chat_template(
                conversation, tokenize=True, add_generation_prompt=request.add_generation_prompt,
                return_dict=False))
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIServingError(f"could not render the messages with the chat template: "
                                     f"{e}", 400, param="messages") from e
