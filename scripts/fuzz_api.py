"""Fuzz a running pagedllm server with schemathesis over its OpenAPI schema (issue #16).

    python scripts/fuzz_api.py http://127.0.0.1:8000 --api-key KEY -n 200 [--seed 0]

For every route of GET /openapi.json: schemathesis' coverage phase (boundary values and type
violations of every field, deterministic), then N positive and N negative examples of its fuzzing
phase. Checks on every response:
- no 5xx (`not_a_server_error`), and schema-invalid data refused (`negative_data_rejection`);
- on the /v1 routes, the response conforms to the schema (status codes excepted: FastAPI documents
  422 where the server answers 400, as OpenAI does; /health and /metrics are documented as JSON,
  which they are not);
- on the completion routes, a 4xx is OpenAI's error object whose `param`, if set, is a top-level
  field of the request, and a 200 is a finished answer (streamed: SSE ending in `[DONE]`, no
  in-stream error); on Anthropic's Messages routes the same with Anthropic's error object, message
  and event stream (message_start ... message_stop);
- GET /health is 200 after every request.
Prints the request count, the status histogram per route and the findings (with the body sent);
exits with status 1 if there is any. tests/entrypoints/openai/test_fuzz.py runs the same over the
tiny test model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection,
                                 not_a_server_error, response_schema_conformance)
from schemathesis.core.failures import FailureGroup

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
# Top-level fields of each completion route's request (an error's `param` must be one of these,
# or an unknown field the request sent).
REQUEST_FIELDS = {COMPLETIONS: frozenset(CompletionRequest.model_fields),
                  CHAT: frozenset(ChatCompletionRequest.model_fields),
                  RESPONSES: frozenset(ResponsesRequest.model_fields)}
FINISH_REASONS = ("stop", "length")
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
ANTHROPIC_REQUEST_FIELDS = {MESSAGES: frozenset(MessagesRequest.model_fields),
                            COUNT_TOKENS: frozenset(CountTokensRequest.model_fields)}
STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")
# Schemathesis reads at most 20 events of an SSE response by default; a streamed answer here has
# one event per token and choice, and must be read whole to check that it ends in [DONE].
MAX_STREAM_EVENTS = 1_000_000


# ------------------------------------------------------------------------------------------------
# What a well-formed answer of the completion routes is (raises AssertionError otherwise).
# ------------------------------------------------------------------------------------------------

def check_error(path: str, sent: Any, status: int, payload: Any) -> None:
    """OpenAI's error object; `param` (when set) names a top-level field of the request."""
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    expected_type = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error")
    assert error["type"] == expected_type, error
    assert error["code"] is None or isinstance(error["code"], str), error
    param = error["param"]
    if param is not None and path in REQUEST_FIELDS:
        sent_fields = set(sent) if isinstance(sent, dict) else set()
        assert param in REQUEST_FIELDS[path] | sent_fields, \
            f"param {param!r} is not a top-level field of the request: {error}"


def check_completion(path: str, payload: Any) -> None:
    """A non-streamed 200: choices numbered from 0, each finished."""
    expected_object = "text_completion" if path == COMPLETIONS else "chat.completion"
    assert payload["object"] == expected_object and isinstance(payload["model"], str), payload
    choices = payload["choices"]
    assert choices and [c["index"] for c in choices] == list(range(len(choices))), payload
    for choice in choices:
        assert choice["finish_reason"] in FINISH_REASONS, choice
        text = choice["text"] if path == COMPLETIONS else choice["message"]["content"]
        assert isinstance(text, str), choice
    usage = payload["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage


def check_sse(text: str) -> None:
    """A streamed 200: `data:` events, no in-stream error, `[DONE]` last, every choice finished."""
    events = [block for block in text.split("\n\n") if block]
    assert events and events[-1] == "data: [DONE]", text[-300:]
    finished: dict[int, bool] = {}
    for event in events[:-1]:
        assert event.startswith("data: "), event
        chunk = json.loads(event[len("data: "):])
        assert "error" not in chunk, f"an error after the 200: {chunk}"
        for choice in chunk["choices"]:
            done = choice.get("finish_reason") is not None
            finished[choice["index"]] = finished.get(choice["index"], False) or done
            if done:
                assert choice["finish_reason"] in FINISH_REASONS, choice
    assert finished and all(finished.values()), f"unfinished choices: {finished}"


def check_response(payload: Any) -> None:
    """A finished Response object of /v1/responses: output items and consistent usage."""
    assert payload["object"] == "response", payload
    assert payload["status"] in ("completed", "incomplete") and payload["output"], payload
    usage = payload["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], usage


def check_responses_sse(text: str) -> None:
    """A streamed 200 of /v1/responses: events numbered from 0, no error event, ending in
    `response.completed` with a finished Response."""
    events = [json.loads(line[len("data: "):]) for block in text.split("\n\n")
              for line in block.splitlines() if line.startswith("data: ")]
    assert events, text[-300:]
    assert [e.get("sequence_number") for e in events] == list(range(len(events))), text[-300:]
    assert not [e for e in events if e["type"] == "error"], f"an error after the 200: {text}"
    assert events[0]["type"] == "response.created", events[0]
    assert events[-1]["type"] == "response.completed", events[-1]
    check_response(events[-1]["response"])


def check_answer(path: str, sent: Any, status: int, content_type: str, text: str) -> None:
    """No 5xx; on the completion routes a well-formed error (4xx) or answer (200).

    Args:
        path: the route; sent: the request body as sent (parsed JSON), or None.
    """
    assert status < 500, f"{status} for {path} {sent!r}: {text[:500]}"
    if path in ANTHROPIC_REQUEST_FIELDS:
        check_anthropic_answer(path, sent, status, content_type, text)
        return
    if path not in REQUEST_FIELDS:
        return
    if 400 <= status < 500:
        check_error(path, sent, status, json.loads(text))
    elif status == 200 and path == RESPONSES:
        if content_type.startswith("text/event-stream"):
            check_responses_sse(text)
        else:
            check_response(json.loads(text))
    elif status == 200:
        if content_type.startswith("text/event-stream"):
            check_sse(text)
        else:
            check_completion(path, json.loads(text))
    else:
        raise AssertionError(f"unexpected status {status} for {path} {sent!r}")


def check_anthropic_error(path: str, sent: Any, status: int, payload: Any) -> None:
    """Anthropic's error object; `param` (when given) names a top-level field of the request."""
    assert isinstance(payload, dict) and payload.get("type") == "error", payload
    assert set(payload) == {"type", "error"}, payload
    error = payload["error"]
    assert isinstance(error, dict) and {"type", "message"} <= set(error) \
        <= {"type", "message", "param"}, error
    assert isinstance(error["message"], str) and error["message"], error
    expected_type = {401: "authentication_error", 404: "not_found_error",
                     413: "request_too_large"}.get(status, "invalid_request_error")
    assert error["type"] == expected_type, error
    param = error.get("param")
    if param is not None:
        sent_fields = set(sent) if isinstance(sent, dict) else set()
        assert param in ANTHROPIC_REQUEST_FIELDS[path] | sent_fields, \
            f"param {param!r} is not a top-level field of the request: {error}"


def check_anthropic_message(payload: Any) -> None:
    """A non-streamed 200 of /v1/messages: a finished assistant message with usage."""
    assert payload["type"] == "message" and payload["role"] == "assistant", payload
    assert payload["stop_reason"] in STOP_REASONS, payload
    assert (payload["stop_sequence"] is not None) == (payload["stop_reason"] == "stop_sequence")
    for block in payload["content"]:
        assert block["type"] in ("text", "thinking", "tool_use"), block
    usage = payload["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] >= 0, usage


def check_anthropic_sse(text: str) -> None:
    """A streamed 200 of /v1/messages: named events whose data's `type` is the name, from
    message_start to message_stop, blocks started and stopped in order, one message_delta with
    the stop reason, no error event."""
    events = []
    for block in (b for b in text.split("\n\n") if b):
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):], block
        assert data["type"] != "error", f"an error after the 200: {data}"
        events.append(data)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", text
    deltas = [e for e in events if e["type"] == "message_delta"]
    assert len(deltas) == 1 and deltas[0]["delta"]["stop_reason"] in STOP_REASONS, deltas
    open_index = None
    for event in events:
        if event["type"] == "content_block_start":
            assert open_index is None, event
            open_index = event["index"]
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index, event
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_index, event
            open_index = None
    assert open_index is None, "a content block was not stopped"


def check_anthropic_answer(path: str, sent: Any, status: int, content_type: str,
                           text: str) -> None:
    """A well-formed error (4xx) or answer (200) of an Anthropic route."""
    if 400 <= status < 500:
        check_anthropic_error(path, sent, status, json.loads(text))
    elif status != 200:
        raise AssertionError(f"unexpected status {status} for {path} {sent!r}")
    elif content_type.startswith("text/event-stream"):
        check_anthropic_sse(text)
    elif path == MESSAGES:
        check_anthropic_message(json.loads(text))
    else:
        assert json.loads(text)["input_tokens"] > 0, text


# ------------------------------------------------------------------------------------------------
# The schemathesis run.
# ------------------------------------------------------------------------------------------------

@dataclass
class Finding:
    operation: str
    problem: str  # the failed check's title, or the assertion message
    status: int
    body: str | None  # the request body as sent
    count: int = 1

    def __str__(self) -> str:
        return (f"{self.operation} -> {self.status} ({self.count}x): {self.problem}\n"
                f"    body: {self.body}")


@dataclass
class FuzzReport:
    """Status counts per operation and the distinct findings (first body kept for each)."""

    statuses: Counter = field(default_factory=Counter)  # (operation label, status) -> count
    findings: dict[tuple[str, str], Finding] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    def add_finding(self, operation: str, problem: str, status: int, body: str | None) -> None:
        key = (operation, problem.splitlines()[0] if problem else "")
        if key in self.findings:
            self.findings[key].count += 1
        else:
            self.findings[key] = Finding(operation, problem, status, body)

    def summary(self) -> str:
        lines = [f"{self.num_requests} requests; status histogram:"]
        lines += [f"  {label:<28} {status}: {count}"
                  for (label, status), count in sorted(self.statuses.items())]
        lines.append(f"{len(self.findings)} findings" + (":" if self.findings else ""))
        lines += [f"  {finding}" for finding in self.findings.values()]
        return "\n".join(lines)


def load_schema(base_url: str, headers: dict[str, str]) -> schemathesis.BaseSchema:
    response = requests.get(base_url.rstrip("/") + "/openapi.json", headers=headers, timeout=30)
    response.raise_for_status()
    config = schemathesis.Config.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    return schemathesis.openapi.from_dict(response.json(), config=config)


def checks_for(path: str, content_type: str, excluded: Collection[str] = ()) -> list:
    """The schemathesis checks for a response of `path`, less those named in `excluded`."""
    checks = [not_a_server_error, negative_data_rejection]
    if path.startswith("/v1/"):
        checks.append(response_schema_conformance)
        if not content_type.startswith("text/event-stream"):  # SSE is not in the schema
            checks.append(content_type_conformance)
    return [check for check in checks if check.__name__ not in excluded]


def _body_text(request: requests.PreparedRequest) -> str | None:
    body = request.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "backslashreplace")
    return body


def _parse(body: str | None) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None  # schemathesis also sends bodies that are not JSON


def run_case(case: schemathesis.Case, base_url: str, headers: dict[str, str],
             session: requests.Session, report: FuzzReport,
             after_each: Callable[[], None] | None = None,
             excluded_checks: Collection[str] = ()) -> None:
    """Send one case, run every check on the answer, and record its status and findings."""
    response = case.call(base_url=base_url, headers=headers, session=session, timeout=60)
    label = case.operation.label
    report.statuses[(label, response.status_code)] += 1
    content_type = (response.headers.get("content-type") or [""])[0]
    body = _body_text(response.request)
    try:
        case.validate_response(
            response, checks=checks_for(case.path, content_type, excluded_checks),
            headers=headers)
    except FailureGroup as group:
        for failure in group.exceptions:
            report.add_finding(label, failure.title, response.status_code, body)
    try:
        check_answer(case.path, _parse(body), response.status_code, content_type, response.text)
        if after_each is not None:
            after_each()
    except (AssertionError, ValueError) as e:
        report.add_finding(label, str(e), response.status_code, body)


def fuzz_operation(operation: Any, base_url: str, headers: dict[str, str], max_examples: int,
                   report: FuzzReport, seed: int | None = None, coverage: bool = True,
                   after_each: Callable[[], None] | None = None,
                   excluded_checks: Collection[str] = ()) -> None:
    """Coverage phase, then `max_examples` positive and negative fuzzing examples of one
    operation (`schema[path][method]`). `seed` None: derandomized (the same cases every run);
    `excluded_checks`: names of schemathesis checks not to run."""
    schema = operation.schema
    with requests.Session() as session:
        if coverage:
            cases: Iterable = schema.iter_coverage_cases(
                operation, generation_modes=list(GenerationMode),
                generation_config=schema.config.generation_for(operation=operation))
            for case in cases:
                run_case(case, base_url, headers, session, report, after_each, excluded_checks)
        for mode in GenerationMode:
            @settings(max_examples=max_examples, deadline=None, derandomize=seed is None,
                      database=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                run_case(case, base_url, headers, session, report, after_each, excluded_checks)
            if seed is not None:
                run = hypothesis_seed(seed)(run)
            try:
                run()
            except Unsatisfiable:
                # No negative data exists for an operation without parameters or body.
                assert mode is GenerationMode.NEGATIVE, operation.label


def fuzz(base_url: str, headers: dict[str, str], max_examples: int, seed: int | None = None,
         coverage: bool = True, excluded_checks: Collection[str] = ()) -> FuzzReport:
    """Fuzz every operation of the server's schema; GET /health must stay 200 throughout."""
    report = FuzzReport()

    def health() -> None:
        status = requests.get(base_url.rstrip("/") + "/health", timeout=30).status_code
        assert status == 200, f"GET /health is {status} after this request"
    schema = load_schema(base_url, headers)
    for result in schema.get_all_operations():
        fuzz_operation(result.ok(), base_url, headers, max_examples, report, seed=seed,
                       coverage=coverage, after_each=health, excluded_checks=excluded_checks)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("-n", "--max-examples", type=int, default=100,
                        help="fuzzing examples per operation and mode (positive, negative)")
    parser.add_argument("--seed", type=int, default=None,
                        help="hypothesis seed (default: derandomized, the same cases each run)")
    parser.add_argument("--no-coverage", action="store_true",
                        help="skip schemathesis' coverage phase")
    parser.add_argument("--exclude-check", action="append", default=[], metavar="NAME",
                        help="a schemathesis check not to run (repeatable), e.g. "
                             "negative_data_rejection")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report = fuzz(args.url, headers, args.max_examples, seed=args.seed,
                  coverage=not args.no_coverage, excluded_checks=args.exclude_check)
    print(report.summary())
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
