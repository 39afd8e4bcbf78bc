"""Beam search on the server (`use_beam_search: true`, vLLM's field): the algorithm of
`LLM.beam_search` (pagedllm/beam_search.py) driven through the async engine.

Each step queues every live beam as a one-token request through `OpenAIServing.admit` (the same
admission gate as any request) and waits for all of them; the beams of a prompt share their
prefix's KV blocks through the prefix cache. The `n` best beams become the request's `n`
choices, ranked best first, each a finished `CompletionOutput`, so the endpoints answer (or
stream, in one piece at the end) exactly as they do for sampled choices.
"""

from __future__ import annotations

from typing import Any

from pagedllm.beam_search import BeamSearch, BeamSearchParams, beam_search_num_logprobs
from pagedllm.entrypoints.openai.serving_engine import (OpenAIServing, OpenAIServingError,
                                                        final_outputs)
from pagedllm.outputs import CompletionOutput, RequestOutput


class FinishedStream:
    """A `RequestStream` stand-in over one already finished output (iterate, close,
    aclose)."""

    def __init__(self, output: RequestOutput) -> None:
        self._output: RequestOutput | None = output

    def __aiter__(self) -> FinishedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._output is None:
            raise StopAsyncIteration
        output, self._output = self._output, None
        return output

    def close(self) -> None:
        self._output = None

    async def aclose(self) -> None:
        self.close()


async def beam_search(serving: OpenAIServing, request: Any, prompt_token_ids: list[list[int]],
                      max_tokens: int, request_id: str) -> list[RequestOutput]:
    """The `request.n` best beams of each prompt as a finished RequestOutput per prompt.

    Args:
        serving: the engine handle and shared checks.
        request: a completion or chat request with `use_beam_search` (its `n` is the width,
            `length_penalty`, `temperature` and `ignore_eos` are read).
        prompt_token_ids: one id list per prompt (already checked and truncated).
        max_tokens: new tokens per beam (already resolved against the context length).
        request_id: the engine ids of the steps' requests start with it.

    Raises:
        OpenAIServingError: 400 naming `n` when 2n alternatives exceed the engine's
            max_logprobs; what `admit` raises for a step; 500/503 if a step fails.
    """
    engine = serving.async_llm
    try:
        num_logprobs = beam_search_num_logprobs(request.n, engine.vocab_size,
                                                engine.input_processor.limits.max_logprobs)
    except ValueError as e:
        raise OpenAIServingError(f"n (the beam width): {e}", 400, param="n") from e
    params = BeamSearchParams(beam_width=request.n, max_tokens=max_tokens,
                              ignore_eos=request.ignore_eos,
                              temperature=request.temperature or 0.0,
                              length_penalty=request.length_penalty)
    search = BeamSearch(prompt_token_ids, params, engine.input_processor.eos_token_ids,
                        num_logprobs)
    step = 0
    while pending := search.pending():
        streams = await serving.admit(request, [({"prompt_token_ids": tokens},
                                                 search.step_params) for tokens in pending],
                                      f"{request_id}-beam{step}")
        finals = await final_outputs(streams, request)
        search.advance([out.outputs[0].logprobs[0] for out in finals])
        step += 1
    outputs = []
    for prompt, result in zip(prompt_token_ids, search.results(serving.tokenizer)):
        outputs.append(RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=prompt, finished=True,
            outputs=[CompletionOutput(index=i, text=beam.text or "",
                                      token_ids=beam.tokens[len(prompt):],
                                      cumulative_logprob=beam.cum_logprob,
                                      finish_reason=beam.finish_reason)
                     for i, beam in enumerate(result.sequences)]))
    return outputs
