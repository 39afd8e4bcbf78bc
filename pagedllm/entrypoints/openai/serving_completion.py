"""POST /v1/completions: one engine request per prompt, answered whole or streamed as SSE.

A request with several prompts runs them concurrently; choice `index` is the prompt's position.
Streaming sends text deltas, one final chunk per choice with its finish_reason, an optional usage
chunk (`stream_options.include_usage`), then `data: [DONE]`. An error after the stream started is
sent as an SSE error object (the status line is already gone).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.entrypoints.openai.protocol import (CompletionChoice, CompletionChunk,
                                                  CompletionRequest, CompletionResponse, now_s,
                                                  random_id)
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing,
                                                        OpenAIServingError, error_from_exception,
                                                        merge_async_iterators, sse_event, usage_of)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _PreparedPrompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


class ServingCompletion:
    """Handler of the completions endpoint.

    Args:
        serving: the shared checks and engine handle.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | AsyncIterator[str]:
        """A response object, or (stream=True) an iterator of SSE lines.

        Raises:
            OpenAIServingError: for an invalid request (before any engine work starts).
        """
        model = self.serving.check_model(request.model)
        self.serving.check_unsupported(request)
        prompts = [self._prepare(p, request) for p in self._split_prompts(request.prompt)]
        response_id, created = random_id("cmpl"), now_s()
        generators = [self.serving.async_llm.generate(
            {"prompt_token_ids": p.token_ids, "prompt": p.text}, p.params, f"{response_id}-{i}")
            for i, p in enumerate(prompts)]
        if request.stream:
            return self._stream(request, prompts, generators, response_id, created, model)
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for index, out in merge_async_iterators(generators):
                finals[index] = out
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            raise error_from_exception(e, list(CompletionRequest.model_fields)) from e
        choices = []
        for index, (prompt, out) in enumerate(zip(prompts, finals)):
            completion = out.outputs[0]
            prefix = self._echo_text(prompt) if request.echo else ""
            choices.append(CompletionChoice(index=index, text=prefix + completion.text,
                                            finish_reason=completion.finish_reason,
                                            stop_reason=completion.stop_reason))
        return CompletionResponse(id=response_id, created=created, model=model, choices=choices,
                                  usage=usage_of(finals))

    async def _stream(self, request: CompletionRequest, prompts: list[_PreparedPrompt],
                      generators: list, response_id: str, created: int,
                      model: str) -> AsyncIterator[str]:
        sent_text = [""] * len(prompts)
        finals: list[RequestOutput | None] = [None] * len(prompts)

        def chunk(index: int, text: str, out: RequestOutput | None = None) -> str:
            completion = out.outputs[0] if out is not None and out.finished else None
            return sse_event(CompletionChunk(id=response_id, created=created, model=model,
                                             choices=[CompletionChoice(
                                                 index=index, text=text,
                                                 finish_reason=completion and
                                                 completion.finish_reason,
                                                 stop_reason=completion and
                                                 completion.stop_reason)]))
        try:
            if request.echo:
                for index, prompt in enumerate(prompts):
                    yield chunk(index, self._echo_text(prompt))
            async for index, out in merge_async_iterators(generators):
                text = out.outputs[0].text
                delta, sent_text[index] = text[len(sent_text[index]):], text
                if delta or out.finished:
                    yield chunk(index, delta, out)
                if out.finished:
                    finals[index] = out
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse_event(CompletionChunk(id=response_id, created=created, model=model,
                                                choices=[], usage=usage_of(finals)))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            error = error_from_exception(e, list(CompletionRequest.model_fields))
            logger.warning("completion stream %s failed: %s", response_id, error.message)
            yield sse_event(error.to_response())
        yield SSE_DONE

    def _prepare(self, prompt: str | list[int], request: CompletionRequest) -> _PreparedPrompt:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.serving.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.serving.check_token_ids(token_ids)
        return _PreparedPrompt(text, token_ids,
                               self.serving.sampling_params(request, len(token_ids)))

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
