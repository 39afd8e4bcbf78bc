"""Fuzzing the OpenAI-compatible server (issue #16): schemathesis over its OpenAPI schema, and
hypothesis over raw JSON bodies sent to the admission gate.

One real server (module scope, subprocess on a free loopback port) over the tiny Llama checkpoint
with `--max-model-len 64`, so every generated request is short whatever its `max_tokens`. The
properties, for every request (the checks live in scripts/fuzz_api.py, which runs the same
schemathesis fuzzing against any URL):
- never a 5xx, and the engine stays alive (GET /health is 200 after every request);
- a 4xx on the completion routes carries OpenAI's error object (Anthropic's on /v1/messages and
  its count_tokens) whose `param`, when set, is a top-level field of the request (a known field or
  the unknown one sent); for a valid body with one field mutated, it names that field;
- a body against the request's JSON schema (a wrong type, an unknown field) gets a 4xx: no
  coercion of `"2"` to 2 (schemathesis' negative_data_rejection, and the hypothesis bodies);
- a 200 is a well-formed answer: every choice has a finish_reason (streamed: an SSE stream ending
  in `[DONE]` with no in-stream error);
- after the run, a greedy completion gives the same text as before it.

Each test prints its request count and status histogram (`pytest -s`). The slow variants
(`-m slow`) send many more examples.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from scripts.fuzz_api import (ANTHROPIC_REQUEST_FIELDS, CHAT, COMPLETIONS, COUNT_TOKENS,
                              MESSAGES, REQUEST_FIELDS, RESPONSES, FuzzReport, check_answer,
                              check_error, fuzz_operation, load_schema)
from tests.entrypoints.openai.server_process import running_server

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 64
SERVE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "16000000", "--seed", "0",
               "--max-model-len", str(MAX_MODEL_LEN)]
GREEDY = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 8,
          "temperature": 0.0}
# Fuzzing examples per operation and generation mode (schemathesis), default and slow runs; the
# hypothesis tests take a few times more (a request costs about 10 ms).
FAST_EXAMPLES, SLOW_EXAMPLES = 20, 1000


class FuzzServer:
    """The server under test, its greedy baseline, and what the fuzzers sent (status counts)."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url
        # A connection per request: after a 500 the server drops the connection, and the next
        # request must still reach it (that is what the liveness checks ask).
        self.client = httpx.Client(base_url=url, headers=AUTH, timeout=60,
                                   limits=httpx.Limits(max_keepalive_connections=0))
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.greedy_text = self.greedy()

    def post(self, path: str, content: bytes) -> httpx.Response:
        response = self.client.post(path, content=content,
                                    headers={"Content-Type": "application/json"})
        self.statuses[(path, response.status_code)] += 1
        return response

    def greedy(self) -> str:
        response = self.client.post(COMPLETIONS, json=GREEDY)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    def assert_alive(self, context: str = "") -> None:
        assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}) {context}"
        health = self.client.get("/health")
        assert health.status_code == 200, f"/health is {health.status_code} {context}"

    def assert_idle(self, timeout_s: float = 10.0) -> None:
        """Nothing left running or waiting in the engine (aborts of abandoned requests may take
        a step to land)."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.client.get("/metrics").text
            busy = [line for line in metrics.splitlines()
                    if line.startswith(("pagedllm:num_requests_running{",
                                        "pagedllm:num_requests_waiting{"))
                    and float(line.rsplit(" ", 1)[1]) != 0]
            if not busy:
                return
            assert time.monotonic() < deadline, f"requests left in the engine: {busy}"
            time.sleep(0.05)

    def report(self, title: str, since: Counter[tuple[str, int]]) -> None:
        sent = self.statuses - since
        print(f"\n{title}: {sum(sent.values())} requests; status histogram:")
        for (path, status), count in sorted(sent.items()):
            print(f"  {path:<24} {status}: {count}")


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    args = ["--model", str(tiny_llama), "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
            "--uvicorn-log-level", "warning", *SERVE_FLAGS]
    with running_server(args) as (proc, url):
        fuzz_server = FuzzServer(proc, url)
        yield fuzz_server
        fuzz_server.client.close()


# ---------------------------------------------------------------------------------------------
# 1. Schemathesis over GET /openapi.json (scripts/fuzz_api.py: coverage phase, then positive and
#    negative fuzzing examples of each operation; every finding is recorded with its body).
# ---------------------------------------------------------------------------------------------

OPERATIONS = [("GET", "/health"), ("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/reset_prefix_cache"),
              ("GET", "/metrics"), ("POST", RESPONSES), ("GET", RESPONSES + "/{response_id}"),
              ("POST", MESSAGES), ("POST", COUNT_TOKENS)]
# The routes the hypothesis tests send bodies to, and the top-level fields of each.
BODY_ROUTES = [COMPLETIONS, CHAT, RESPONSES, MESSAGES, COUNT_TOKENS]
FIELDS = {**REQUEST_FIELDS, **ANTHROPIC_REQUEST_FIELDS}


@pytest.fixture(scope="module")
def api_schema(server: FuzzServer):
    return load_schema(server.url, AUTH)


def test_schema_lists_every_route(api_schema) -> None:
    listed = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


def _schemathesis(server: FuzzServer, api_schema, method: str, path: str,
                  max_examples: int) -> None:
    report = FuzzReport()
    fuzz_operation(api_schema[path][method], server.url, AUTH, max_examples, report,
                   after_each=server.assert_alive)
    server.statuses.update({(path, status): n for (_, status), n in report.statuses.items()})
    print(f"\nschemathesis {method} {path}: {report.summary()}")
    assert not report.findings, report.summary()


# The default run fuzzes the cheap operations by schema; the generation routes' bodies are
# fuzzed by the hypothesis tests below in the default run and by schemathesis with -m slow.
@pytest.mark.parametrize("method, path", [
    pytest.param(m, p, marks=pytest.mark.slow) if m == "POST" and p in BODY_ROUTES else (m, p)
    for m, p in OPERATIONS])
def test_schemathesis(server: FuzzServer, api_schema, method: str, path: str) -> None:
    _schemathesis(server, api_schema, method, path, FAST_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_schemathesis_slow(server: FuzzServer, api_schema, method: str, path: str) -> None:
    _schemathesis(server, api_schema, method, path, SLOW_EXAMPLES)


# ---------------------------------------------------------------------------------------------
# 2. Hypothesis over raw JSON bodies: random dicts of real and junk fields, mutations of valid
#    bodies, non-object bodies.
# ---------------------------------------------------------------------------------------------

_EDGE_INTS = [0, -1, 1, 2, 63, 64, 65, 128, 129, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -2**63,
              -2**63 - 1, 2**64, 10**30, -10**30]
_EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-6, 0.5, 1.5, 2.000001,
                100.0, 1e308, -1e308]
_SURROGATES = ["\ud800", "\udfff", "\udbff"]  # lone UTF-16 surrogates: valid JSON, not text
_EDGE_STRINGS = ["", " ", "\x00", "0", "9", "1e3", "-1", "true", "null", "NaN", "none", "text",
                 "json_object", "user", "assistant", MODEL_NAME, "</s>", "<s>", "é" * 40,
                 "a" * 300, *_SURROGATES, "a\udc00b"]
_NESTED_KEYS = ["role", "content", "type", "text", "json", "regex", "choice", "grammar",
                "json_object", "json_schema", "schema", "include_usage",
                "continuous_usage_stats", "name", "0", "5"]
_ALL_FIELDS = sorted(frozenset().union(*FIELDS.values()))

# hypothesis' text never holds surrogates: some are spliced in.
_text = st.text(max_size=12) | st.builds(lambda a, s, b: a + s + b, st.text(max_size=4),
                                         st.sampled_from(_SURROGATES), st.text(max_size=4))
_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from(_EDGE_INTS)
            | st.floats() | st.sampled_from(_EDGE_FLOATS) | _text
            | st.sampled_from(_EDGE_STRINGS))
junk = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.sampled_from(_NESTED_KEYS) | _text, inner, max_size=4)),
    max_leaves=10)
# NOTE(fuzz): top-level names without lone surrogates: such a name is blamed on "body", a field no
# request has (test_surrogate_field_name_is_not_blamed_on_body, xfailed); use _text once fixed.
_field_names = st.sampled_from(_ALL_FIELDS) | st.text(max_size=10)


def _valid_message() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.text(max_size=20) | st.just([{"type": "text", "text": "hi"}])})


_ids = st.integers(0, 511)
# A value each field may validly take (so that valid variants reach the engine and get 200s).
_VALID: dict[str, st.SearchStrategy] = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2), "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3),
                                                       max_size=3),
    "stop_token_ids": st.lists(_ids, max_size=3), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2), "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "truncate_prompt_tokens": st.integers(1, 8),
    "stream": st.booleans(), "user": st.text(max_size=5),
    "logit_bias": st.dictionaries(_ids.map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(_ids, min_size=1, max_size=5),
    "bad_words": st.lists(st.text(min_size=1, max_size=4).filter(str.strip), max_size=2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "guided_choice": st.just(["yes", "no"]), "guided_regex": st.just("[a-z]{1,4}"),
    "max_tokens": st.integers(1, 6),
}
_VALID_COMPLETION = {**_VALID, "echo": st.booleans(), "logprobs": st.integers(0, 5),
                     "prompt": st.text(min_size=1, max_size=20)
                     | st.lists(_ids, min_size=1, max_size=8)
                     | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=2)}
_VALID_CHAT = {**_VALID, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
               "max_completion_tokens": st.integers(1, 6), "add_generation_prompt": st.booleans(),
               "messages": st.lists(_valid_message(), min_size=1, max_size=2)}
_VALID_RESPONSES = {
    **{name: _VALID[name] for name in ("temperature", "top_p", "top_k", "min_p",
                                       "repetition_penalty", "seed", "stream", "user")},
    "max_output_tokens": st.integers(1, 6), "instructions": st.text(max_size=20),
    "store": st.booleans(), "parallel_tool_calls": st.booleans(),
    "input": st.text(min_size=1, max_size=20)
    | st.lists(_valid_message().map(lambda m: {**m, "content": m["content"] if isinstance(
        m["content"], str) else [{"type": "input_text", "text": "hi"}]}), min_size=1,
        max_size=2),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "n",
                                         "schema": {"type": "object"}}}]),
    "metadata": st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
}
_TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
_VALID_COUNT_TOKENS = {
    "system": st.text(max_size=10) | st.just([{"type": "text", "text": "Be brief."}]),
    "tools": st.just([_TOOL]),
    "tool_choice": st.sampled_from([{"type": "any"}, {"type": "none"},
                                    {"type": "tool", "name": "f"}]),
    "thinking": st.just({"type": "adaptive"}),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant"]),
        "content": st.text(max_size=20) | st.just([{"type": "text", "text": "hi"}])}),
        max_size=2).map(lambda turns: [*turns, {"role": "user", "content": "hi"}])}
_VALID_MESSAGES = {**_VALID_COUNT_TOKENS, "max_tokens": st.integers(1, 6),
                   "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1),
                   "top_k": st.integers(1, 50), "stream": st.booleans(),
                   "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=3),
                   "metadata": st.just({"user_id": "u"})}
_POOLS = {COMPLETIONS: _VALID_COMPLETION, CHAT: _VALID_CHAT, RESPONSES: _VALID_RESPONSES,
          MESSAGES: _VALID_MESSAGES, COUNT_TOKENS: _VALID_COUNT_TOKENS}
_BASE = {COMPLETIONS: {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4},
         CHAT: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4},
         RESPONSES: {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4},
         MESSAGES: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4},
         COUNT_TOKENS: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}}
# A 4xx caused by one mutated field may name another: a longer prompt overflows the context
# through max_tokens (the request's own request_param mapping); a Responses request's
# instructions are part of its rendered input, and a Messages request's system prompt is the
# conversation's first message.
_ALSO_BLAMED = {"prompt": {"max_tokens"}, "messages": {"max_tokens"},
                "input": {"max_output_tokens"}, "instructions": {"input", "max_output_tokens"},
                "system": {"messages", "max_tokens"}}


@st.composite
def valid_variants(draw, path: str) -> dict:
    """The base body plus a few fields with valid values (may still be refused: e.g.
    stream_options without stream)."""
    pool = _POOLS[path]
    names = draw(st.lists(st.sampled_from(sorted(pool)), max_size=5, unique=True))
    return {**_BASE[path], **{name: draw(pool[name]) for name in names}}


@st.composite
def mutations(draw, path: str) -> tuple[dict, str]:
    """(body, field): the base body with one field set to junk, an edge value, or deleted, or
    with an unknown field added."""
    body = dict(_BASE[path])
    kind = draw(st.sampled_from(["junk", "edge", "delete", "unknown"]))
    if kind == "unknown":
        name = draw((st.sampled_from(["body", ""]) | st.text(max_size=10)).filter(
            lambda s: s not in FIELDS[path]))
        body[name] = draw(junk)
        return body, name
    names = sorted(FIELDS[path]) if kind != "delete" else sorted(body)
    name = draw(st.sampled_from(names))
    if kind == "delete":
        del body[name]
    elif kind == "edge":
        body[name] = draw(st.sampled_from(_EDGE_INTS) | st.sampled_from(_EDGE_FLOATS)
                          | st.sampled_from(_EDGE_STRINGS) | st.just(None) | st.booleans())
    else:
        body[name] = draw(junk)
    return body, name


def random_bodies(path: str) -> st.SearchStrategy[Any]:
    """Random dicts mixing real field names with junk values, valid variants, and non-objects."""
    return st.one_of(st.dictionaries(_field_names, junk, max_size=8),
                     st.builds(lambda base, extra: {**base, **extra},
                               valid_variants(path), st.dictionaries(_field_names, junk,
                                                                     max_size=2)),
                     valid_variants(path), _scalars, st.lists(junk, max_size=4))


# The request schemas the server publishes (its OpenAPI components).
_VALIDATORS = {path: jsonschema.Draft202012Validator(model.model_json_schema())
               for path, model in ((COMPLETIONS, CompletionRequest),
                                   (CHAT, ChatCompletionRequest),
                                   (RESPONSES, ResponsesRequest), (MESSAGES, MessagesRequest),
                                   (COUNT_TOKENS, CountTokensRequest))}


def _send(server: FuzzServer, path: str, body: Any) -> httpx.Response:
    """Send `body`; check the answer, that a body against the request's schema is refused
    (no coercion: `"2"` is not an int), and that the server is still alive."""
    # json.dumps writes NaN/Infinity literals (not JSON, sent on purpose) and huge ints as digits.
    response = server.post(path, json.dumps(body).encode())
    check_answer(path, body, response.status_code, response.headers.get("content-type", ""),
                 response.text)
    if not _VALIDATORS[path].is_valid(body):
        assert 400 <= response.status_code < 500, \
            f"{response.status_code} for a body against the request schema: {body!r}"
    server.assert_alive(f"after {path} {body!r}")
    return response


_HYPOTHESIS_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                            suppress_health_check=[HealthCheck.too_slow,
                                                   HealthCheck.filter_too_much,
                                                   HealthCheck.data_too_large])


@pytest.fixture
def counts(server: FuzzServer, request: pytest.FixtureRequest):
    before = server.statuses.copy()
    yield
    server.report(request.node.name, before)


def _random_bodies_test(server: FuzzServer, max_examples: int) -> None:
    @settings(max_examples=max_examples, **_HYPOTHESIS_SETTINGS)
    @given(path=st.sampled_from(BODY_ROUTES), data=st.data())
    def run(path: str, data: st.DataObject) -> None:
        _send(server, path, data.draw(random_bodies(path), label="body"))
    run()


def _mutations_test(server: FuzzServer, max_examples: int) -> None:
    @settings(max_examples=max_examples, **_HYPOTHESIS_SETTINGS)
    @given(path=st.sampled_from(BODY_ROUTES), data=st.data())
    def run(path: str, data: st.DataObject) -> None:
        body, field = data.draw(mutations(path), label="body, mutated field")
        response = _send(server, path, body)
        if 400 <= response.status_code < 500:
            param = response.json()["error"].get("param")
            blamed = {field} | _ALSO_BLAMED.get(field, set())
            assert param in blamed, f"param {param!r} for a body whose {field!r} was " \
                                    f"mutated: {body!r} -> {response.text}"
    run()


def test_random_bodies(server: FuzzServer, counts: None) -> None:
    _random_bodies_test(server, max_examples=150)


def test_mutated_bodies_blame_the_field(server: FuzzServer, counts: None) -> None:
    _mutations_test(server, max_examples=200)


@pytest.mark.slow
def test_random_bodies_slow(server: FuzzServer, counts: None) -> None:
    _random_bodies_test(server, max_examples=SLOW_EXAMPLES)


@pytest.mark.slow
def test_mutated_bodies_blame_the_field_slow(server: FuzzServer, counts: None) -> None:
    _mutations_test(server, max_examples=SLOW_EXAMPLES)


def _concurrent_test(server: FuzzServer, max_examples: int, batch: int) -> None:
    """Batches of random bodies and mutations sent at once, a fifth of them abandoned by the
    client after a few ms; then nothing may be left running or waiting in the engine."""
    any_body = st.sampled_from(BODY_ROUTES).flatmap(
        lambda path: st.tuples(st.just(path), random_bodies(path)
                               | mutations(path).map(lambda mutated: mutated[0])))

    async def send(client: httpx.AsyncClient, path: str, body: Any, abandon: bool) -> None:
        content = json.dumps(body).encode()
        if abandon:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.post(path, content=content), timeout=0.01)
            return
        response = await client.post(path, content=content)
        server.statuses[(path, response.status_code)] += 1
        check_answer(path, body, response.status_code,
                     response.headers.get("content-type", ""), response.text)

    async def send_all(requests: list[tuple[str, Any]], abandon: list[bool]) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={**AUTH, "Content-Type": "application/json"}) as c:
            await asyncio.gather(*(send(c, path, body, gone)
                                   for (path, body), gone in zip(requests, abandon)))

    # No shrinking: a failing batch is reported as sent (shrinking batches takes minutes).
    @settings(max_examples=max_examples, phases=[Phase.explicit, Phase.generate],
              **_HYPOTHESIS_SETTINGS)
    @given(requests=st.lists(any_body, min_size=batch, max_size=batch),
           abandon=st.lists(st.sampled_from([False] * 4 + [True]), min_size=batch,
                            max_size=batch))
    def run(requests: list[tuple[str, Any]], abandon: list[bool]) -> None:
        asyncio.run(send_all(requests, abandon))
        server.assert_alive()
        server.assert_idle()
    run()


def test_concurrent_bodies_and_disconnects(server: FuzzServer, counts: None) -> None:
    _concurrent_test(server, max_examples=4, batch=24)


@pytest.mark.slow
def test_concurrent_bodies_and_disconnects_slow(server: FuzzServer, counts: None) -> None:
    _concurrent_test(server, max_examples=40, batch=48)


def test_non_json_bodies(server: FuzzServer, counts: None) -> None:
    """Malformed JSON and non-object bodies get 400 without a param."""
    for path in BODY_ROUTES:
        for raw in (b"", b"{", b"null", b"[]", b"5", b'"x"', b"\xff\xfe", b"{'prompt': 1}",
                    b'{"prompt": "hi",}', b"[" * 100_000 + b"]" * 100_000,
                    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"):
            response = server.post(path, raw)
            assert response.status_code == 400, (raw[:60], response.text)
            check_answer(path, None, 400, response.headers["content-type"], response.text)
            assert response.json()["error"].get("param") is None, response.text
    server.assert_alive()


# Regressions of this fuzzing's findings (issue #16, fixed in b684021). Each body must get a 4xx
# error naming `param`; before the fix:
# surrogate-*: a lone UTF-16 surrogate (a valid JSON escape, not encodable text) gave a 500.
# unknown-field-body: an unknown field named "body" got param null.
# lax-*: a value of the wrong JSON type was coerced (pydantic's lax mode) and answered 200.
# choice-string: a string choice was taken as a list of its characters (200 for "a" or "b").
# structured_outputs-empty: `{}` was ignored (offline, SamplingParams refuses it).
# logit_bias-key-5_0: the key "5_0" was read as token 50 (Python's int() accepts "5_0", " 5 ").
_FINDINGS = [
    pytest.param('{"prompt": "\\ud800", "max_tokens": 2}', "prompt", id="surrogate-prompt"),
    pytest.param('{"prompt": ["\\ud800"], "max_tokens": 2}', "prompt",
                 id="surrogate-prompt-list"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "bad_words": ["\\ud800"]}', "bad_words",
                 id="surrogate-bad_words"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "model": "\\ud800"}', "model",
                 id="surrogate-model"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "body": 1}', "body",
                 id="unknown-field-body"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "temperature": false}', "temperature",
                 id="lax-temperature-false"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "temperature": "0.5"}', "temperature",
                 id="lax-temperature-string"),
    pytest.param('{"prompt": "hi", "max_tokens": "2"}', "max_tokens", id="lax-max_tokens-string"),
    pytest.param('{"prompt": "hi", "max_tokens": true}', "max_tokens",
                 id="lax-max_tokens-true"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "n": true}', "n", id="lax-n-true"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "echo": "yes"}', "echo",
                 id="lax-echo-yes"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "stream": "on"}', "stream",
                 id="lax-stream-on"),
    pytest.param('{"prompt": [true], "max_tokens": 2}', "prompt", id="lax-token-id-true"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": "ab"}}',
                 "structured_outputs", id="choice-string"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "structured_outputs": {}}',
                 "structured_outputs", id="structured_outputs-empty"),
    pytest.param('{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5_0": 1}}', "logit_bias",
                 id="logit_bias-key-5_0"),
]


@pytest.mark.parametrize("raw, param", _FINDINGS)
def test_fuzz_findings(server: FuzzServer, raw: str, param: str) -> None:
    response = server.post(COMPLETIONS, raw.encode())
    server.assert_alive()
    assert 400 <= response.status_code < 500, response.text
    check_error(COMPLETIONS, json.loads(raw), response.status_code, response.json())
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("raw", ['{"\\ud800": null}', '{"prompt": "hi", "\\ud800": 1}'])
def test_surrogate_field_name_is_not_blamed_on_body(server: FuzzServer, raw: str) -> None:
    response = server.post(COMPLETIONS, raw.encode())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in (None, "\ud800"), response.text


# Regression (issue #16): admission runs on the server's event loop, so a request slow to admit
# stalls every other request, /health included: 20k bad_words took ~11 s when their token
# sequences were deduplicated in a list (quadratic); now one batched tokenizer call and a set.
_SLOW_TO_ADMIT = [
    pytest.param({"prompt": "hi", "max_tokens": 2, "bad_words": [f"w{i}" for i in range(20000)]},
                 id="bad_words-20k"),
]


@pytest.mark.slow
@pytest.mark.parametrize("body", _SLOW_TO_ADMIT)
def test_slow_admission_does_not_stall_health(server: FuzzServer, body: dict) -> None:
    done = threading.Event()

    def send() -> None:
        try:
            server.post(COMPLETIONS, json.dumps(body).encode())
        finally:
            done.set()
    sender = threading.Thread(target=send)
    sender.start()
    worst = 0.0
    while not done.wait(0.1):
        start = time.monotonic()
        server.assert_alive()
        worst = max(worst, time.monotonic() - start)
    sender.join()
    assert worst < 1.0, f"GET /health took {worst:.1f} s while the request was admitted"


# ---------------------------------------------------------------------------------------------
# After all of the above (tests run in file order): the engine still serves, with the same
# greedy answer as before the fuzzing.
# ---------------------------------------------------------------------------------------------

def test_engine_alive_after_fuzzing(server: FuzzServer) -> None:
    server.assert_alive("after the fuzzing")
    assert server.greedy() == server.greedy_text
    total = sum(server.statuses.values())
    print(f"\nall fuzz tests: {total} requests; "
          f"{dict(Counter(status for _, status in server.statuses.elements()))}")
