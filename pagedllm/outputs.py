"""User-facing results: RequestOutput and CompletionOutput (vLLM's shapes and names)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass
class Logprob:
    """One token's log-probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token id: Logprob} holding the chosen token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token, the same; the first prompt token has None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: index of this sequence among the request's `n` outputs.
        text: detokenized output (a stop string, or the text of a `stop_token_ids` token that
            ended it, removed unless include_stop_str_in_output; an EOS's text never in it).
        token_ids: generated token ids (the stop token or EOS id that ended it included).
        logprobs: per generated token, {token id: Logprob} (when SamplingParams.logprobs is set).
        cumulative_logprob: sum of the chosen tokens' logprobs (when logprobs is set).
        finish_reason: None while running, then "stop" (EOS, stop token or stop string),
            "length" (max_tokens or max_model_len), "abort", or "error" (something that
            belongs to this request alone failed inside a step: see `error`).
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
        error: with finish_reason "error", what failed (e.g. its logits processor's exception).
        routed_experts: with the final output, on an engine built with
            `enable_return_routed_experts` (vLLM's): [num_tokens - 1, num_moe_layers, top_k] int32
            numpy array, the experts each MoE layer's router chose (logical ids in the
            router's order: by descending weight for softmax top-k routers) for every token of
            prompt + output but the last, which was never an input; -1 where none is known.
            Cached prompt tokens carry the routing recorded when their blocks were computed.
            The rows follow the tokens returned, also when a stop string ended the request
            (tokens of the same step after the one that completed it are dropped with their
            rows). None otherwise (a request with `return_routed_experts=False`, a disabled
            engine, outputs before the final one, an aborted or failed request).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    routed_experts: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as the user sees it.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt text (None when the prompt was given as token ids).
        prompt_token_ids: prompt token ids.
        outputs: one `CompletionOutput` per sequence.
        finished: whether the request is done.
        prompt_logprobs: per prompt token (when SamplingParams.prompt_logprobs is set).
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # A KV connector's answer with the final output (prefill/decode disaggregation: what the
    # decode instance needs; docs/kv_connectors.md); None: none.
    kv_transfer_params: dict | None = None

    def add_delta(self, later: RequestOutput) -> RequestOutput:
        """This DELTA output followed by `later` (the next DELTA output of the same request) as
        one DELTA output (vLLM's `RequestOutput.add` with aggregation): each sequence's new text,
        token ids and logprobs concatenated, its state (finish and stop reasons, error,
        cumulative logprob) and the request's (finished, metrics, ...) taken from `later`; the
        prompt logprobs, sent once, kept from whichever carries them. Neither is modified."""
        merged = {c.index: replace(c, token_ids=list(c.token_ids),
                                   logprobs=None if c.logprobs is None else list(c.logprobs))
                  for c in self.outputs}
        for c in later.outputs:
            first = merged.get(c.index)
            if first is None:
                merged[c.index] = c
                continue
            logprobs = (c.logprobs if first.logprobs is None else
                        first.logprobs + (c.logprobs or []))
            merged[c.index] = replace(c, text=first.text + c.text,
                                      token_ids=first.token_ids + list(c.token_ids),
                                      logprobs=logprobs)
        return replace(later, outputs=[merged[i] for i in sorted(merged)],
                       prompt_logprobs=later.prompt_logprobs or self.prompt_logprobs)

    @property
    def error(self) -> str | None:
        """What failed, if a sequence ended with finish_reason "error"; else None."""
        for completion in self.outputs:
            if completion.finish_reason == "error":
                return completion.error or "the request failed"
        return None
