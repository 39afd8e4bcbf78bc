"""OutputProcessor: EngineCoreOutputs (token deltas) -> RequestOutputs (text, stop strings).

Detokenizes each request incrementally, applies stop strings (a match finishes the request with
finish_reason "stop" and stop_reason the string; the caller must then abort it in the core), and
keeps the cumulative outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class OutputProcessor:
    """Per-request detokenization and output assembly for the front end."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self.request_states[request_id] = RequestState(request_id, prompt, prompt_token_ids,
                                                       detok)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.request_states.pop(req_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs of this step, ids the core must abort: stop-string hits)."""
        request_outputs, to_abort = [], []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            state.num_cached_tokens = out.num_cached_tokens
            stop_str = state.detokenizer.update(out.new_token_ids)
            if stop_str is not None:
                state.finish_reason, state.stop_reason = "stop", stop_str
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            request_outputs.append(self._make_output(state))
            if state.finish_reason is not None:
                del self.request_states[out.request_id]
        return request_outputs, to_abort

    def _make_output(self, state: RequestState) -> RequestOutput:
        finished = state.finish_reason is not None
        detok = state.detokenizer
        completion = CompletionOutput(
            index=0, text=detok.get_next_output_text(finished, delta=False),
            token_ids=list(detok.token_ids), finish_reason=state.finish_reason,
            stop_reason=state.stop_reason)
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=[completion],
                             finished=finished, num_cached_tokens=state.num_cached_tokens)
