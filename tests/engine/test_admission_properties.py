"""Property tests of the engine's admission gate, offline (issue #16).

`SamplingParams(**kwargs)` with random kwargs (the real field names, values of random types: valid
ones, edge values, huge ints, NaN, junk) either raises ValueError or builds an object whose
validation is idempotent. A built one, sent to `LLM.generate` next to a plain greedy request, either
is refused by a GenerateError naming that request alone, or finishes; the greedy request finishes
with the same tokens as when it runs alone, and the LLM stays usable. The slow variants (`-m slow`)
try many more examples. The HTTP side of the gate is fuzzed in
tests/entrypoints/openai/test_fuzz.py.
"""

from __future__ import annotations

import dataclasses
import math
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, GenerateError, RequestOutputKind, SamplingParams

MAX_MODEL_LEN = 64
ENGINE_KWARGS = {"dtype": "float32", "kv_cache_memory_bytes": 16_000_000, "seed": 0,
                 "max_model_len": MAX_MODEL_LEN}
GREEDY_PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = "hello there"
FIELDS = sorted(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class FixtureLLM:
    """The LLM under test and its greedy answer to GREEDY_PROMPT, run alone."""

    def __init__(self, checkpoint: Path) -> None:
        self.llm = LLM(str(checkpoint), **ENGINE_KWARGS)
        self.greedy_tokens = self.greedy()
        self.prompt_len = len(self.llm.get_tokenizer()(PROMPT).input_ids)

    def greedy(self) -> list[int]:
        [out] = self.llm.generate([GREEDY_PROMPT], GREEDY, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    def assert_usable(self) -> None:
        assert not self.llm.llm_engine.has_unfinished_requests()
        assert self.greedy() == self.greedy_tokens


@pytest.fixture(scope="module")
def fixture_llm(tiny_llama: Path) -> FixtureLLM:
    return FixtureLLM(tiny_llama)


# ---------------------------------------------------------------------------------------------
# Random kwargs.
# ---------------------------------------------------------------------------------------------

def _raising_processor(token_ids, logits):
    raise RuntimeError("a user logits processor failed")


# Logits processors that work, fail, or return something odd (a failing one fails its request
# alone).
_PROCESSORS = {
    "identity": lambda token_ids, logits: logits,
    "raises": _raising_processor,
    "returns None": lambda token_ids, logits: None,
    "wrong shape": lambda token_ids, logits: logits[:3],
    "nan": lambda token_ids, logits: logits * math.nan,
    "-inf": lambda token_ids, logits: logits * 0 - math.inf,
    "a list": lambda token_ids, logits: logits.tolist(),
}
_EDGE_INTS = [0, -1, 1, 2, 63, 64, 65, 128, 129, 511, 512, 2**31, 2**63 - 1, 2**63, -2**63,
              -2**63 - 1, 10**30]
_EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-6, 1e-5, 0.5, 1.0, 2.0,
                2.000001, 100.0, 1e308]
# hypothesis' text never holds lone surrogates (not encodable text): some are spliced in.
_text = st.text(max_size=8) | st.builds(lambda a, s: a + s, st.text(max_size=4),
                                        st.sampled_from(["\ud800", "\udfff"]))
_python_only = st.sampled_from([b"x", (1, 2), frozenset({3}), {4, 5}, 1j, Decimal("0.5"),
                                Fraction(1, 3), np.float32(0.5), np.int64(3), object(),
                                RequestOutputKind.DELTA, print])
_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from(_EDGE_INTS)
            | st.floats() | st.sampled_from(_EDGE_FLOATS) | _text | _python_only)
junk = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar",
                                                      "json_object", "type", "enum", "0", "7"])
                                     | _text, inner, max_size=3)),
    max_leaves=8)

_ids = st.integers(0, 511)
_VALID: dict[str, st.SearchStrategy] = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(1e-3, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(1e-3, 3), "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3),
                                                       max_size=3),
    "stop_token_ids": st.lists(_ids, max_size=4), "ignore_eos": st.booleans(),
    # Mostly short (the default run stays fast), sometimes up to the context length.
    "max_tokens": st.one_of(*[st.integers(1, 8)] * 3, st.sampled_from([None, 63, 64, 2**63 - 1])),
    "min_tokens": st.integers(0, 4), "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.none() | st.integers(0, 20), "prompt_logprobs": st.none() | st.integers(0, 5),
    "logit_bias": st.dictionaries(_ids | _ids.map(str), st.floats(-100, 100), max_size=4),
    "allowed_token_ids": st.lists(_ids, min_size=1, max_size=6),
    "bad_words": st.lists(st.text(min_size=1, max_size=4).filter(str.strip), max_size=2),
    "truncate_prompt_tokens": st.none() | st.integers(1, 80), "detokenize": st.booleans(),
    "output_kind": st.sampled_from(list(RequestOutputKind)),
    "logits_processors": st.lists(st.sampled_from(sorted(_PROCESSORS)).map(_PROCESSORS.get),
                                  max_size=2),
    "structured_outputs": st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-c]{1,3}"},
                                           {"json_object": True},
                                           {"json": {"type": "integer"}}]),
    # (An engine without a KV connector ignores kv_transfer_params.)
    "extra_args": st.none() | st.fixed_dictionaries({}, optional={
        "kv_transfer_params": st.dictionaries(
            st.sampled_from(["do_remote_decode", "do_remote_prefill", "remote_port", "x"]),
            st.booleans() | st.integers(0, 70000) | st.text(max_size=4), max_size=3)}),
    # (An engine without enable_return_routed_experts ignores it.)
    "return_routed_experts": st.booleans(),
}
assert set(_VALID) == set(FIELDS), set(FIELDS) ^ set(_VALID)


_bad_values = st.one_of(st.sampled_from(_EDGE_INTS), st.sampled_from(_EDGE_FLOATS), junk)


@st.composite
def sampling_kwargs(draw) -> dict[str, Any]:
    """A few real field names with valid values, then at most one field (mostly) or several set
    to an edge value or junk."""
    names = draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True))
    kwargs = {name: draw(_VALID[name]) for name in names}
    bad = draw(st.lists(st.sampled_from(FIELDS), max_size=1, unique=True)
               | st.lists(st.sampled_from(FIELDS), max_size=6, unique=True))
    kwargs.update({name: draw(_bad_values) for name in bad})
    return kwargs


# ---------------------------------------------------------------------------------------------
# Properties.
# ---------------------------------------------------------------------------------------------

def build(kwargs: dict[str, Any]) -> SamplingParams | None:
    """SamplingParams(**kwargs), or None if it raised ValueError (any other error fails)."""
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return None
    # Validation is idempotent: the normalized object passes it again unchanged.
    assert dataclasses.replace(params) == params
    assert params.temperature >= 0 and 0 < params.top_p <= 1 and params.n >= 1
    return params


def _most_tokens(fixture_llm: FixtureLLM, params: SamplingParams) -> int:
    """The most tokens a request on PROMPT may generate: max_tokens, capped by the context."""
    prompt_len = fixture_llm.prompt_len
    if params.truncate_prompt_tokens is not None:
        prompt_len = min(prompt_len, params.truncate_prompt_tokens)
    room = MAX_MODEL_LEN - prompt_len
    return room if params.max_tokens is None else min(params.max_tokens, room)


def generate_next_to_greedy(fixture_llm: FixtureLLM, params: SamplingParams) -> None:
    """Run `params` on PROMPT next to the greedy request; check both answers and the LLM."""
    llm = fixture_llm.llm
    try:
        greedy_out, out = llm.generate([GREEDY_PROMPT, PROMPT], [GREEDY, params], use_tqdm=False)
    except GenerateError as e:
        assert set(e.errors) == {1}, f"the error names other requests: {e.errors}"
        assert e.errors[1] and f"request 1: {e.errors[1]}" in str(e)
        greedy_out, out = e.outputs
        assert out is None or out.error is not None, e.outputs
    assert greedy_out.finished and list(greedy_out.outputs[0].token_ids) == \
        fixture_llm.greedy_tokens, "the greedy request was disturbed"
    if out is not None and out.error is None:
        assert out.finished and len(out.outputs) == params.n, out
        most = _most_tokens(fixture_llm, params)
        for completion in out.outputs:
            num = len(completion.token_ids)
            assert completion.finish_reason in ("stop", "length"), completion
            assert num <= most, (num, most, completion)
            if completion.finish_reason == "length":
                assert num == most, f"finished by length after {num} of {most} tokens"
            if params.logprobs is not None:
                assert len(completion.logprobs) == num
    assert not llm.llm_engine.has_unfinished_requests()


@settings(max_examples=200, **_SETTINGS)
@given(kwargs=sampling_kwargs())
def test_sampling_params_build_or_value_error(kwargs: dict[str, Any]) -> None:
    build(kwargs)


@pytest.mark.slow
@settings(max_examples=5000, **_SETTINGS)
@given(kwargs=sampling_kwargs())
def test_sampling_params_build_or_value_error_slow(kwargs: dict[str, Any]) -> None:
    build(kwargs)


def _generate_test(fixture_llm: FixtureLLM, max_examples: int) -> None:
    counts = {"ValueError": 0, "built": 0}

    @settings(max_examples=max_examples, **_SETTINGS)
    @given(kwargs=sampling_kwargs())
    def run(kwargs: dict[str, Any]) -> None:
        params = build(kwargs)
        counts["built" if params is not None else "ValueError"] += 1
        if params is not None:
            generate_next_to_greedy(fixture_llm, params)
    run()
    print(f"\nSamplingParams: {counts}")
    fixture_llm.assert_usable()


def test_generate_with_random_params(fixture_llm: FixtureLLM) -> None:
    _generate_test(fixture_llm, max_examples=30)


@pytest.mark.slow
def test_generate_with_random_params_slow(fixture_llm: FixtureLLM) -> None:
    _generate_test(fixture_llm, max_examples=1000)


# Regressions of this fuzzing's findings (issue #16, fixed in b684021): each must be refused with
# a ValueError from SamplingParams or a GenerateError naming the request, or (delta) give the
# whole output. Before the fix:
# structured-set: a non-JSON value in a schema raised TypeError out of LLM.generate.
# bad_words-surrogate: the tokenizer raised TypeError on a lone surrogate.
# choice-string: a string choice was taken as a list of its characters.
# logit_bias-float-key: the key 1.5 was read as token 1.
# logits_processors-int: a non-iterable logits_processors raised TypeError.
# delta: LLM.generate with output_kind=DELTA returned only the last delta (vLLM's LLM forces
#   FINAL_ONLY).
_FINDINGS = [
    pytest.param({"structured_outputs": {"json": {"enum": [{1, 2}]}}}, id="structured-set"),
    pytest.param({"bad_words": ["\ud800"]}, id="bad_words-surrogate"),
    pytest.param({"structured_outputs": {"choice": "ab"}}, id="choice-string"),
    pytest.param({"logit_bias": {1.5: 1.0}}, id="logit_bias-float-key"),
    pytest.param({"logits_processors": 0}, id="logits_processors-int"),
    pytest.param({"output_kind": RequestOutputKind.DELTA, "temperature": 0.0, "max_tokens": 8},
                 id="delta"),
]


@pytest.mark.parametrize("kwargs", _FINDINGS)
def test_admission_findings(fixture_llm: FixtureLLM, kwargs: dict[str, Any]) -> None:
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return
    try:
        [out] = fixture_llm.llm.generate([GREEDY_PROMPT], params, use_tqdm=False)
    except GenerateError as e:
        assert set(e.errors) == {0}
        return
    finally:
        fixture_llm.assert_usable()
    assert kwargs.get("output_kind") is RequestOutputKind.DELTA, f"accepted: {out}"
    assert list(out.outputs[0].token_ids) == fixture_llm.greedy_tokens
