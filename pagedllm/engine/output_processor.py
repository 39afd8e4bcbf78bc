"""OutputProcessor: EngineCoreOutputs (token deltas) -> RequestOutputs.

Per request it detokenizes incrementally, applies stop strings (a match finishes the request with
finish_reason "stop" and stop_reason the string; the caller must then abort it in the core),
leaves the text of the stop token that ended a request in the core out of the text (an EOS's
always, a `stop_token_ids` hit's unless include_stop_str_in_output; the id stays in token_ids),
collects logprobs and prompt logprobs, keeps each request's routed experts (the rows every delta
brings, core/routed_experts.py; returned with the final output for the tokens returned), and
emits outputs per `output_kind` (cumulative, delta or final only). Requests with n > 1 are n
child requests in the core; their parent here gathers the children's CompletionOutputs (by
index) into one RequestOutput.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.routed_experts import RoutedExpertsRecord
from pagedllm.core.sched_output import EngineCoreOutput, LogprobsLists
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.logprob_strings import ContextDecoder
from pagedllm.outputs import (CompletionOutput, Logprob, PromptLogprobs, RequestOutput,
                              SampleLogprobs)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ParentRequest:
    """The user's request when n > 1: child request ids and their latest outputs by index."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    output_kind: RequestOutputKind
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    finished_children: set[int] = field(default_factory=set)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestState:
    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    parent: ParentRequest | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # Logprob token strings in context (logprob_strings.ContextDecoder): of the generated tokens
    # after the prompt, and of the prompt tokens from the start.
    logprob_decoder: ContextDecoder | None = None
    prompt_logprob_decoder: ContextDecoder | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0
    kv_transfer_params: dict | None = None
    # Routed-experts capture: the rows received so far by position, and, set when the request
    # finishes (not aborted, not failed), [num_tokens - 1, num_moe_layers, top_k] int32.
    routing: RoutedExpertsRecord | None = None
    routed_experts: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Per-request detokenization, logprobs and output assembly for the front end."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
        state = RequestState(request_id, index, prompt, prompt_token_ids, params, detok, parent)
        decode_args = dict(skip_special_tokens=params.skip_special_tokens,
                           spaces_between_special_tokens=params.spaces_between_special_tokens)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
            state.logprob_decoder = ContextDecoder(self.tokenizer, prompt_token_ids, **decode_args)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
            if prompt_token_ids:
                state.prompt_logprob_decoder = ContextDecoder(self.tokenizer, [], **decode_args)
                state.prompt_logprob_decoder.add(prompt_token_ids[0])
        self.request_states[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.request_states.pop(req_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs of this step, ids the core must abort: stop-string hits and
        requests whose own processing failed here).

        A failure while processing one request (its detokenization, its logprobs) finishes that
        request with finish_reason "error"; the other requests are unaffected.
        """
        request_outputs, to_abort = [], []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            try:
                self._update_state(state, out)
                if state.finished and not out.finished:
                    to_abort.append(out.request_id)
                if _routing_only(out) and not state.finished:
                    continue  # a prefill chunk's routing rows: nothing to tell the caller
                request_output = self._make_output(state)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                logger.exception("request %s failed in output processing", out.request_id)
                if not out.finished:
                    to_abort.append(out.request_id)
                state.finish_reason, state.stop_reason = "error", None
                state.error = f"output processing failed: {type(e).__name__}: {e}"
                state.detokenizer = None  # what failed may be the detokenizer
                request_output = self._make_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
            if state.finished:
                del self.request_states[out.request_id]
        return request_outputs, to_abort

    def _update_state(self, state: RequestState, out: EngineCoreOutput) -> None:
        state.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, *out.new_prompt_logprobs)
        if out.new_token_ids:
            self._add_tokens(state, out)
        if out.finished and not state.finished:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            state.error = out.error
        if out.new_routed_experts is not None:
            if state.routing is None:
                state.routing = RoutedExpertsRecord()
            start, rows = out.new_routed_experts
            state.routing.write(start, rows.to_numpy())
        if state.finished and state.routing is not None and state.finish_reason not in (
                "abort", "error"):
            # Every returned token but the last was an input of some forward. A stop string
            # found here may have cut the core's tokens short (the rest of this delta, e.g.
            # accepted drafts, is dropped): their routing is dropped with them.
            num_inputs = len(state.prompt_token_ids) + len(state.token_ids) - 1
            state.routed_experts = state.routing.result(num_inputs)
            state.routing = None
        if state.finished and state.logprob_decoder is not None:
            # Tokens still held (an unfinished character at the end): their text, as the output
            # text has it, goes to the last token.
            rest = state.logprob_decoder.flush()
            state.logprob_decoder = None
            if rest and state.logprobs:
                chosen = state.logprobs[-1][state.token_ids[-1]]
                chosen.decoded_token = (chosen.decoded_token or "") + rest

    # ----------------------------------------------------------------- accumulation
    def _add_tokens(self, state: RequestState, out: EngineCoreOutput) -> None:
        new_token_ids = out.new_token_ids
        detok = state.detokenizer
        if detok is not None:
            # The core finishes with "stop" only on a stop token, its step's last token: EOS
            # (stop_reason None; also a grammar that terminated on EOS) or one of stop_token_ids
            # (stop_reason the id). Its text is left out (see IncrementalDetokenizer).
            stop_terminated = out.finish_reason == "stop"
            eos = stop_terminated and not isinstance(out.stop_reason, int)
            # With stop strings, several tokens of one step (accepted drafts, a multi-step round)
            # go in one at a time, as separate steps would: the token that completes a match is
            # the request's last.
            batches = [[t] for t in new_token_ids] if detok.stop else [new_token_ids]
            for i, batch in enumerate(batches):
                stop_str = detok.update(batch, stop_terminated and i == len(batches) - 1,
                                        eos=eos)
                if stop_str is not None:
                    state.finish_reason, state.stop_reason = "stop", stop_str
                    new_token_ids = new_token_ids[:i + 1]
                    break
        num_new = len(new_token_ids)
        state.token_ids.extend(new_token_ids)
        if state.logprobs is not None and out.new_logprobs is not None:
            new = self._to_logprob_dicts(out.new_logprobs.slice(0, num_new),
                                         state.logprob_decoder)
            state.logprobs.extend(new)
            state.cumulative_logprob += sum(lp[0] for lp in out.new_logprobs.logprobs[:num_new])

    def _add_prompt_logprobs(self, state: RequestState, start: int,
                             lists: LogprobsLists) -> None:
        have = len(state.prompt_logprobs)
        skip = max(0, have - start)  # positions already received (recompute after preemption)
        if start > have:
            raise AssertionError(f"prompt logprobs gap for {state.request_id}: have {have}, "
                                 f"got from {start}")
        new = self._to_logprob_dicts(lists.slice(skip, len(lists.ranks)),
                                     state.prompt_logprob_decoder)
        state.prompt_logprobs.extend(new)
        decoder = state.prompt_logprob_decoder
        if decoder is not None and len(state.prompt_logprobs) >= len(state.prompt_token_ids):
            rest = decoder.flush()  # text of prompt tokens still held at the prompt's end
            state.prompt_logprob_decoder = None
            last = state.prompt_logprobs[-1]
            if rest and last is not None:
                chosen = last[state.prompt_token_ids[len(state.prompt_logprobs) - 1]]
                chosen.decoded_token = (chosen.decoded_token or "") + rest

    @staticmethod
    def _to_logprob_dicts(lists: LogprobsLists, decoder: ContextDecoder | None
                          ) -> list[dict[int, Logprob]]:
        """Logprob dicts of consecutive positions. Each position's alternatives are decoded in the
        context of the tokens before it, then its chosen token is appended to `decoder` (whose
        text for that token becomes the chosen token's string)."""
        result = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            chosen = ids[0]
            entry = {tid: Logprob(lp, i, None if decoder is None or tid == chosen
                                  else decoder.alternative(tid))
                     for i, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1)}
            text = decoder.add(chosen) if decoder is not None else None
            if chosen not in entry:
                entry[chosen] = Logprob(lps[0], rank, text)
            else:
                entry[chosen].rank = rank
                entry[chosen].decoded_token = text
            result.append(entry)
        return result

    # ----------------------------------------------------------------- output assembly
    def _completion(self, state: RequestState, delta: bool) -> CompletionOutput:
        finished = state.finished
        text = "" if state.detokenizer is None else state.detokenizer.get_next_output_text(
            finished, delta)
        start = state.sent_tokens if delta else 0
        state.sent_tokens = len(state.token_ids)
        return CompletionOutput(
            index=state.index, text=text, token_ids=state.token_ids[start:],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else state.logprobs[start:],
            finish_reason=state.finish_reason, stop_reason=state.stop_reason, error=state.error,
            routed_experts=state.routed_experts if finished else None)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        parent = state.parent
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        completion = self._completion(state, delta=kind == RequestOutputKind.DELTA)
        if parent is None:
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                                 [completion], state.finished, state.prompt_logprobs,
                                 state.num_cached_tokens,
                                 kv_transfer_params=state.kv_transfer_params)
        parent.outputs[state.index] = completion
        if state.finished:
            parent.finished_children.add(state.index)
        if state.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = state.prompt_logprobs
        parent.num_cached_tokens = max(parent.num_cached_tokens, state.num_cached_tokens)
        finished = len(parent.finished_children) == parent.n
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outputs = ([completion] if kind == RequestOutputKind.DELTA
                   else [parent.outputs[i] for i in sorted(parent.outputs)])
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             finished, parent.prompt_logprobs, parent.num_cached_tokens)


def _routing_only(out: EngineCoreOutput) -> bool:
    """Whether `out` carries nothing but routed-experts rows (an unfinished prefill chunk)."""
    return (not out.new_token_ids and not out.finished and out.new_prompt_logprobs is None
            and out.new_routed_experts is not None)
