"""POST /v1/completions: one engine request per prompt, answered whole or streamed as SSE.

A request with several prompts runs them concurrently; with `n` sequences per prompt, choice
`index` = prompt position * n + sequence index (OpenAI's and vLLM's order). Streaming sends text
deltas, one final chunk per choice with its finish_reason, an optional usage chunk
(`stream_options.include_usage`), then `data: [DONE]`. An error after the stream started is sent
as an SSE error object (the status line is already gone).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pagedllm.entrypoints.openai.protocol import (CompletionChoice, CompletionChunk,
                                                  CompletionLogprobs, CompletionRequest,
                                                  CompletionResponse, now_s)
from pagedllm.entrypoints.openai.serving_beam_search import FinishedStream, beam_search
from pagedllm.engine.async_llm import RequestStream
from pagedllm.engine.logprob_strings import token_strings
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing,
                                                        OpenAIServingError, SSEChunkFrame,
                                                        SSEStream, clamp_logprob,
                                                        error_from_exception, final_outputs,
                                                        merge_async_iterators, sse_event,
                                                        text_choice_json, token_string,
                                                        usage_of, usage_so_far)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Most sequences (prompts x n) one completions request may start: a larger batch would hold the
# engine for a long time on one client's behalf; clients send several requests instead.
MAX_SEQUENCES_PER_REQUEST = 1024


@dataclass
class _PreparedPrompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class _ChoiceProgress:
    """What a streamed choice has sent so far."""

    echo_chars: int = 0  # length of the echoed prompt
    num_chars: int = 0  # of the completion text
    num_tokens: int = 0
    token_chars: int = 0  # of the sent tokens' logprob strings (text offsets continue from it)
    finished: bool = False


@dataclass
class _Delta:
    """A streamed choice's fields (a `CompletionChoice` once serialized; see `_stream`)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        num_top: int, text_offset: int,
                        result: CompletionLogprobs | None = None,
                        tokens: list[str] | None = None,
                        as_token_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's completions logprobs for tokens, appended to `result`.

    A token's string is its text in context (`Logprob.decoded_token`, or `tokens[i]` when given),
    so the strings join to the text and `text_offset` (from `text_offset`) indexes into it; with
    `as_token_ids` (vLLM's return_tokens_as_token_ids) tokens show as "token_id:<id>" and the
    offsets still index the text. An entry of None (the first prompt token) gets null logprobs;
    it needs `tokens`."""
    result = result or CompletionLogprobs()
    for i, (token_id, entry) in enumerate(zip(token_ids, logprobs)):
        text = tokens[i] if tokens is not None else entry[token_id].decoded_token or ""
        token = token_string(token_id, text, as_token_ids)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        chosen = entry[token_id]
        result.token_logprobs.append(clamp_logprob(chosen.logprob))
        top = {token_string(tid, lp.decoded_token or "", as_token_ids): clamp_logprob(lp.logprob)
               for tid, lp in entry.items() if num_top > 0 and tid != token_id}
        if num_top > 0:
            top[token] = clamp_logprob(chosen.logprob)  # the chosen token under its own string
        result.top_logprobs.append(top)
    result._end_offset = text_offset
    return result


class ServingCompletion:
    """Handler of the completions endpoint.

    Args:
        serving: the shared checks and engine handle.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | SSEStream:
        """A response object, or (stream=True) the SSE stream.

        Raises:
            OpenAIServingError: for an invalid request (before any byte is sent), a request that
                failed alone (500) or a dead engine (503).
        """
        model = self.serving.check_request(request, "logprobs")
        texts = self._split_prompts(request.prompt)
        if len(texts) * request.n > MAX_SEQUENCES_PER_REQUEST:
            raise OpenAIServingError(
                f"{len(texts)} prompts x n={request.n} would be {len(texts) * request.n} "
                f"sequences, more than {MAX_SEQUENCES_PER_REQUEST} per request; send several "
                f"requests", 400, param="n" if request.n > MAX_SEQUENCES_PER_REQUEST else "prompt")
        if request.kv_transfer_params is not None and (len(texts) != 1
                                                       or request.use_beam_search):
            raise OpenAIServingError("kv_transfer_params (prefill/decode disaggregation) needs "
                                     "one prompt and no beam search", 400,
                                     param="kv_transfer_params")
        prompts = [self._prepare(p, request) for p in texts]
        response_id, engine_id = self.serving.request_ids(request, "cmpl")
        created = now_s()
        if request.use_beam_search:
            finals = await beam_search(self.serving, request, [p.token_ids for p in prompts],
                                       min(p.params.max_tokens for p in prompts), engine_id)
            streams = [FinishedStream(final) for final in finals]
        else:
            streams = await self.serving.admit(
                request, [({"prompt_token_ids": p.token_ids, "prompt": p.text}, p.params)
                          for p in prompts], engine_id)
        if request.stream:
            return SSEStream(self._stream(request, prompts, streams, response_id, created, model),
                             streams)
        finals = await final_outputs(streams, request)
        choices = []
        for prompt_index, (prompt, out) in enumerate(zip(prompts, finals)):
            prefix = self._echo_text(prompt) if request.echo else ""
            for completion in out.outputs:
                choices.append(CompletionChoice(
                    index=prompt_index * request.n + completion.index,
                    text=prefix + completion.text,
                    logprobs=self._logprobs(request, completion, 0, len(prefix),
                                            self._prompt_logprobs(request, prompt, out)),
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=response_id, created=created, model=model, choices=choices,
                                  usage=usage_of(finals),
                                  kv_transfer_params=finals[0].kv_transfer_params)

    async def _stream(self, request: CompletionRequest, prompts: list[_PreparedPrompt],
                      streams: list[RequestStream], response_id: str, created: int,
                      model: str) -> AsyncIterator[str]:
        progress = {i: _ChoiceProgress() for i in range(len(prompts) * request.n)}
        finals: list[RequestOutput | None] = [None] * len(prompts)
        options = request.stream_options

        frame = SSEChunkFrame(CompletionChunk(id=response_id, created=created, model=model,
                                              choices=[]))
        continuous_usage = options is not None and options.continuous_usage_stats

        def chunk(choice: CompletionChoice | _Delta, prompt_index: int) -> str:
            if isinstance(choice, _Delta):
                if choice.logprobs is None and not continuous_usage:
                    # The common case, serialized without pydantic models (SSEChunkFrame).
                    return frame.event(text_choice_json(choice.index, choice.text,
                                                        choice.finish_reason,
                                                        choice.stop_reason))
                choice = CompletionChoice(index=choice.index, text=choice.text,
                                          logprobs=choice.logprobs,
                                          finish_reason=choice.finish_reason,
                                          stop_reason=choice.stop_reason)
            usage = None
            if continuous_usage:
                usage = usage_so_far(len(prompts[prompt_index].token_ids),
                                     progress[choice.index].num_tokens)
            return sse_event(CompletionChunk(id=response_id, created=created, model=model,
                                             choices=[choice], usage=usage))
        try:
            if request.echo:
                for prompt_index, prompt in enumerate(prompts):
                    for i in range(request.n):
                        text = self._echo_text(prompt)
                        progress[prompt_index * request.n + i].echo_chars = len(text)
                        yield chunk(CompletionChoice(index=prompt_index * request.n + i,
                                                     text=text), prompt_index)
            async with aclosing(merge_async_iterators(streams)) as merged:
                async for prompt_index, out in merged:
                    for completion in out.outputs:
                        index = prompt_index * request.n + completion.index
                        choice = self._next_delta(request, index, completion, progress[index])
                        if choice is not None:
                            yield chunk(choice, prompt_index)
                    if out.finished:
                        finals[prompt_index] = out
            if options is not None and options.include_usage:
                yield sse_event(CompletionChunk(id=response_id, created=created, model=model,
                                                choices=[], usage=usage_of(finals)))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            error = error_from_exception(e, request)
            logger.warning("completion stream %s failed: %s", response_id, error.message)
            yield sse_event(error.to_response())
        yield SSE_DONE

    def _next_delta(self, request: CompletionRequest, index: int, completion: CompletionOutput,
                    progress: _ChoiceProgress) -> _Delta | None:
        """The choice (as a `_Delta`) carrying what `completion` adds to what was sent; None if
        nothing."""
        if progress.finished:
            return None
        delta = completion.text[progress.num_chars:]
        finished = completion.finish_reason is not None
        if not delta and not finished and len(completion.token_ids) == progress.num_tokens:
            return None
        offset = progress.echo_chars + progress.token_chars
        logprobs = self._logprobs(request, completion, progress.num_tokens, offset)
        if logprobs is not None:
            progress.token_chars = logprobs._end_offset - progress.echo_chars
        progress.num_chars += len(delta)
        progress.num_tokens = len(completion.token_ids)
        progress.finished = finished
        if not delta and not finished and logprobs is None:
            return None
        return _Delta(index, delta, logprobs, completion.finish_reason, completion.stop_reason)

    @staticmethod
    def _logprobs(request: CompletionRequest, completion: CompletionOutput, start: int,
                  text_offset: int, prompt_part: CompletionLogprobs | None = None
                  ) -> CompletionLogprobs | None:
        if request.logprobs is None or completion.logprobs is None:
            return None
        if prompt_part is not None:
            text_offset = prompt_part._end_offset
        return completion_logprobs(completion.token_ids[start:], completion.logprobs[start:],
                                   request.logprobs, text_offset, copy.deepcopy(prompt_part),
                                   as_token_ids=request.return_tokens_as_token_ids)

    def _prompt_logprobs(self, request: CompletionRequest, prompt: _PreparedPrompt,
                         out: RequestOutput) -> CompletionLogprobs | None:
        """With echo and logprobs: the prompt tokens' logprobs (from prompt_logprobs)."""
        if not request.echo or request.logprobs is None or out.prompt_logprobs is None:
            return None
        # The prompt tokens' strings in context, decoded as `_echo_text` decodes the ids when no
        # text was given; with text, they join to it wherever the tokenizer round-trips it.
        tokens = token_strings(self.serving.tokenizer, prompt.token_ids,
                               skip_special_tokens=prompt.text is not None)
        return completion_logprobs(prompt.token_ids, out.prompt_logprobs, request.logprobs, 0,
                                   tokens=tokens, as_token_ids=request.return_tokens_as_token_ids)

    def _prepare(self, prompt: str | list[int], request: CompletionRequest) -> _PreparedPrompt:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.serving.tokenize(prompt, request)
        else:
            text, token_ids = None, list(prompt)
        self.serving.check_token_ids(token_ids)
        token_ids, params = self.serving.prepare(request, token_ids)
        if params.truncate_prompt_tokens is not None:
            text = None  # the prompt text no longer matches the (truncated) ids
        if request.echo and request.logprobs is not None:
            params.prompt_logprobs = request.logprobs
        return _PreparedPrompt(text, token_ids, params)

    def _echo_text(self, prompt: _PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.serving.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    @staticmethod
    def _split_prompts(prompt: str | list) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise OpenAIServingError("prompt must not be empty", 400, param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        return list(prompt)
