"""SamplingParams: per-request decoding settings, with vLLM's field names and semantics.

Validation happens in `__post_init__` and raises `ValueError` naming the field, so an invalid request
is refused before it reaches the engine and never disturbs other requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
# Integer fields are stored in int64 (seeds, counts) on the worker side: larger values are refused
# here rather than overflowing inside a step.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_int(name: str, value: Any, minimum: int, message: str | None = None) -> None:
    """Raises ValueError naming `name` unless `value` is an int (not a bool) in
    [minimum, INT64_MAX]."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or not minimum <= value <= INT64_MAX:
        bound = f">= {minimum}" if minimum > INT64_MIN else "in the int64 range"
        too_large = isinstance(value, int) and value > INT64_MAX
        limit = f" (at most {INT64_MAX})" if too_large else ""
        raise ValueError(f"{name} {message or f'must be an int {bound}'}{limit}, got {value!r}")


def _check_float(name: str, value: Any) -> None:
    """Raises ValueError naming `name` unless `value` is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_text(name: str, text: str) -> None:
    """Raises ValueError naming `name` for text that is not valid Unicode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid Unicode text (it has a lone surrogate)") from None


def _parse_logit_bias(logit_bias: Any) -> dict[int, float]:
    """{token id (int or decimal string): bias} -> {int: float}; ids >= 0, biases finite in
    [-100, 100] (OpenAI's range). Raises ValueError naming `logit_bias`."""
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {logit_bias!r}")
    parsed: dict[int, float] = {}
    for key, bias in logit_bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token_id = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token_id = key
        else:
            raise ValueError(f"logit_bias keys must be token ids (ints or decimal strings), "
                             f"got {key!r}")
        check_int("logit_bias", token_id, 0, message="keys must be token ids (ints >= 0)")
        _check_float("logit_bias", bias)
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        parsed[token_id] = float(bias)
    return parsed


class RequestOutputKind(Enum):
    """What each streamed RequestOutput carries: everything so far, only the new part, or only
    the final result."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# A per-request logits processor: (output token ids so far, logits [vocab] float32) -> logits.
LogitsProcessor = Callable[[list[int], Any], Any]


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample one request (vLLM semantics).

    Attributes:
        n: number of output sequences per prompt; each is an independent request sharing the
            prompt's KV blocks through the prefix cache, with seed `seed + i` when seeded.
        temperature: 0 means greedy; must be >= 0.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens with probability < min_p * p_max; in [0, 1].
        presence_penalty, frequency_penalty: in [-2, 2], OpenAI semantics, over output tokens.
        repetition_penalty: > 0; CTRL-style (Keskar et al. 2019) over prompt and output tokens.
        seed: per-request RNG seed; outputs do not depend on what else is batched.
        stop: strings that end generation (cut from the text unless include_stop_str_in_output).
        stop_token_ids: token ids that end generation (kept in token_ids; in the text only with
            include_stop_str_in_output. An EOS is never in the text).
        ignore_eos: keep generating after EOS.
        max_tokens: most tokens to generate (None = up to max_model_len).
        min_tokens: generate at least this many before EOS/stop tokens may end the request.
        skip_special_tokens, spaces_between_special_tokens: detokenization options.
        include_stop_str_in_output: keep the matched stop string (or the stop token's text)
            in the text.
        logprobs: return the sampled token's logprob and rank plus the top-`logprobs`
            alternatives per generated token (0 = only the sampled token); None = off.
        prompt_logprobs: the same for every prompt token (the first one gets None).
        logit_bias: {token id: bias added to its logit} (OpenAI semantics, bias in [-100, 100]).
        allowed_token_ids: if set, only these tokens can be sampled.
        bad_words: words whose token sequences are banned where they would complete.
        truncate_prompt_tokens: keep only the last k prompt tokens.
        detokenize: False = return token ids only (text stays empty; stop strings unavailable).
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY (for streaming).
        logits_processors: callables `(output_token_ids, logits [vocab]) -> logits` applied to
            this request's logits before sampling, in order.
        structured_outputs: a `StructuredOutputsParams` (or a dict of its fields): the output
            must satisfy a JSON schema, regex, choice or grammar.
        extra_args: plain data for engine components (vLLM's); "kv_transfer_params" (an
            object) is read by the KV connector (prefill/decode disaggregation,
            docs/kv_connectors.md).
        return_routed_experts: on an engine built with `enable_return_routed_experts`, return
            this request's routed experts with its final output
            (`CompletionOutput.routed_experts`); False skips them (nothing is copied for it).
            Without the engine option this field does nothing (the output has None).

    Raises:
        ValueError: on any out-of-range field, naming it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logits_processors: list[LogitsProcessor] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    return_routed_experts: bool = True
    # Set by the engine (generation config, tokenizer); not user fields.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from e
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got "
                             f"{self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect (vLLM does the same).
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        for name, lo in (("n", 1), ("max_tokens", 1), ("min_tokens", 0), ("logprobs", 0),
                         ("prompt_logprobs", 0), ("truncate_prompt_tokens", 1)):
            value = getattr(self, name)
            if value is not None or name in ("n", "min_tokens"):
                check_int(name, value, lo)
        check_int("top_k", self.top_k, 0, message="must be -1 (disable), 0 (disable) or >= 1")
        if self.seed is not None:
            check_int("seed", self.seed, INT64_MIN)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_float(name, getattr(self, name))
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for s in self.stop:
            check_text("stop", s)
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0, message="must be token ids (ints >= 0)")
        if self.logit_bias is not None:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                check_int("allowed_token_ids", t, 0, message="must be token ids (ints >= 0)")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError("bad_words must be a list of non-empty strings")
        for word in self.bad_words or ():
            check_text("bad_words", word)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be a boolean, got "
                             f"{self.return_routed_experts!r}")
        if self.extra_args is not None and (
                not isinstance(self.extra_args, dict)
                or not all(isinstance(k, str) for k in self.extra_args)):
            raise ValueError("extra_args must be an object with string keys")
        if not isinstance((self.extra_args or {}).get("kv_transfer_params", {}), dict):
            raise ValueError("extra_args: kv_transfer_params must be an object")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.logits_processors is not None and (
                not isinstance(self.logits_processors, (list, tuple))
                or not all(callable(p) for p in self.logits_processors)):
            raise ValueError("logits_processors must be a list of callables")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def reads_previous_tokens(self) -> bool:
        """Whether sampling each token reads the request's tokens before it: penalties (over
        prompt and output), bad words (the tokens a word would complete) and logits processors
        (the output ids). The one home of this fact: the scheduler runs such requests in
        synchronous steps (`request_needs_sync_step`), the runner gives them neither drafts nor
        the plain-greedy path (`RequestStates`)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or bool(self.bad_words)
                or bool(self._bad_words_token_ids) or bool(self.logits_processors))

    @property
    def all_stop_token_ids(self) -> set[int]:
        """`stop_token_ids` plus the model's EOS ids (unless ignore_eos), set by the engine."""
        return self._all_stop_token_ids

    def update_from_generation_config(self, eos_token_ids: tuple[int, ...]) -> None:
        """Add the model's EOS ids to the stop set (called by the engine when a request arrives)."""
        if not self.ignore_eos:
            self._all_stop_token_ids = set(self.stop_token_ids) | set(eos_token_ids)
