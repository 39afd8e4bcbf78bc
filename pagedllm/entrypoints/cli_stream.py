"""Stepping an offline engine for the interactive command line (`generate`, `chat`).

Requests run as `RequestOutputKind.DELTA` outputs of the engine's own output processor (its
incremental detokenizer and stop strings), handed to a callback as they come. Ctrl-C while the
engine steps does not raise inside a step: SIGINT only sets a flag, which is read between steps,
and the unfinished requests are then aborted in the engine (their KV blocks freed) and reported
as interrupted with the text they had so far.
"""

from __future__ import annotations

import copy
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.input_processor import PromptType, context_length_error
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


@dataclass
class StreamResult:
    """What one request produced.

    Attributes:
        text: the output text (the partial text if interrupted).
        num_prompt_tokens / num_output_tokens: token counts.
        num_cached_tokens: prompt tokens served from the prefix cache.
        finish_reason: "stop", "length", "abort" (interrupted) or "error".
        error: the engine's message for a request that failed inside a step, else None.
        elapsed: seconds from admission to the last output (model loading excluded).
    """

    text: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    elapsed: float = 0.0

    @property
    def interrupted(self) -> bool:
        return self.finish_reason == "abort"


def add_cli_request(engine: LLMEngine, prompt: PromptType, params: SamplingParams,
                    max_tokens_given: bool) -> str:
    """Validate and queue one request as a DELTA stream; returns its request id.

    An explicit max_tokens (`max_tokens_given`) that cannot fit the context is refused with the
    server's message (`context_length_error`); a default one is cut to what the context leaves,
    as the server does with a model's default.

    Raises:
        ValueError: the engine refuses the request, or max_tokens does not fit.
    """
    params = copy.copy(params)
    params.output_kind = RequestOutputKind.DELTA
    request_id = engine.next_request_id()
    core_req, prompt_text = engine.input_processor.process(request_id, prompt, params)
    if max_tokens_given:
        too_long = context_length_error(engine.config.max_model_len,
                                        len(core_req.prompt_token_ids), params.max_tokens)
        if too_long is not None:
            raise ValueError(too_long)
    engine.add_processed_request(core_req, prompt_text)
    return request_id


@contextmanager
def sigint_as_flag() -> Iterator[threading.Event]:
    """While active (main thread only), SIGINT sets the yielded event instead of raising
    KeyboardInterrupt; the previous handler is restored on exit."""
    pressed = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def run_streams(engine: LLMEngine, request_ids: list[str],
                on_delta: Callable[[str, str], None] | None = None) -> dict[str, StreamResult]:
    """Step `engine` until every request of `request_ids` has finished or Ctrl-C is pressed.

    `on_delta(request_id, text)` receives each new piece of text as the engine produces it.
    After Ctrl-C the unfinished requests are aborted (finish_reason "abort") and the others keep
    what they finished with. Any exception from the engine aborts this call's requests first.

    Returns:
        request id -> StreamResult.
    """
    start = time.perf_counter()
    results = {r: StreamResult() for r in request_ids}
    pending = set(request_ids)
    try:
        with sigint_as_flag() as interrupted:
            while pending and not interrupted.is_set():
                for out in engine.step():
                    result = results.get(out.request_id)
                    if result is None:
                        continue
                    completion = out.outputs[0]
                    result.text += completion.text
                    result.num_prompt_tokens = len(out.prompt_token_ids or ())
                    result.num_output_tokens += len(completion.token_ids)
                    result.num_cached_tokens = out.num_cached_tokens
                    result.elapsed = time.perf_counter() - start
                    if on_delta is not None and completion.text:
                        on_delta(out.request_id, completion.text)
                    if out.finished:
                        result.finish_reason = completion.finish_reason
                        result.error = out.error
                        pending.discard(out.request_id)
    finally:
        if pending:
            engine.abort_request(sorted(pending))
            for request_id in pending:
                results[request_id].finish_reason = "abort"
                results[request_id].elapsed = time.perf_counter() - start
    return results
