"""Issue #16's cases as regression tests: no request can hurt another or stop the server.

One server (module scope) over the tiny Llama checkpoint; every test ends by checking that the
server still answers a normal request, so a case that kills the engine fails loudly here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.server_process import free_port, running_server, wait_healthy

MODEL = "tiny-llama"


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, vocab_size: int) -> None:
        self.proc, self.url, self.vocab_size = proc, url, vocab_size
        self.port = int(url.rsplit(":", 1)[1])

    def post(self, path: str, body: dict | str | bytes, timeout: float = 60,
             headers: dict | None = None) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, timeout=timeout,
                          headers={"Content-Type": "application/json", **(headers or {})})

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def assert_healthy(self) -> None:
        """The engine is alive and serves a normal request."""
        assert self.proc.poll() is None
        assert httpx.get(self.url + "/health", timeout=10).status_code == 200
        r = self.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4,
                                          "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Running/waiting requests and KV usage go back to zero."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = [self.metric(f"pagedllm:{n}") for n in
                      ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
            if values == [0.0, 0.0, 0.0]:
                return
            assert time.monotonic() < deadline, f"not idle: running/waiting/kv = {values}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    vocab_size = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    args = ["--model", str(tiny_llama), "--served-model-name", MODEL, "--dtype", "float32",
            "--kv-cache-memory-bytes", "4000000", "--max-model-len", "256",
            "--max-request-body-bytes", "100000", "--uvicorn-log-level", "warning"]
    with running_server(args) as (proc, url):
        yield Server(proc, url, vocab_size)


def _assert_400(response: httpx.Response, param: str | None, status: int = 400) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


# ----------------------------------------------------------------- 1. dropped connections

def _send_and_close(server: Server, body: dict, read_bytes: int = 0) -> None:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(data)).encode()
                     + b"\r\n\r\n" + data)
        if read_bytes:
            sock.recv(read_bytes)


def test_streaming_client_that_closes_at_once_kills_nothing(server: Server) -> None:
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    for i in range(12):
        _send_and_close(server, body, read_bytes=64 if i % 3 == 2 else 0)
        _send_and_close(server, {**body, "stream": False})
    server.assert_healthy()
    server.wait_idle()


def test_disconnect_mid_stream_frees_the_request(server: Server) -> None:
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for _ in zip(range(3), r.iter_lines()):
            pass
    server.wait_idle()
    server.assert_healthy()


# ----------------------------------------------------------------- 2-4. integer ranges, vocab ids

@pytest.mark.parametrize("field,value", [("seed", 2**63), ("seed", -(2**63) - 1),
                                         ("top_k", 2**70), ("n", 2**70), ("n", 10**9),
                                         ("truncate_prompt_tokens", 2**70), ("min_tokens", 2**64),
                                         ("max_tokens", 2**63), ("max_tokens", -5),
                                         ("logprobs", 10**6), ("presence_penalty", 5)])
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_numbers_are_400_naming_the_field(server: Server, field: str, value: int,
                                                       stream: bool) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, field: value, "stream": stream}
    _assert_400(server.post("/v1/completions", body), field)


def test_huge_top_k_and_seed_in_range_run(server: Server) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "top_k": 2**62,
            "seed": 2**63 - 1, "n": 2, "temperature": 1.0}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    server.assert_healthy()


@pytest.mark.parametrize("field,make", [
    ("stop_token_ids", lambda v: [v + 10]),
    ("allowed_token_ids", lambda v: [v]),
    ("logit_bias", lambda v: {str(v + 10): 1}),
    ("prompt", lambda v: [1, v]),
])
@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_outside_the_vocabulary_are_400(server: Server, field, make,
                                                  stream: bool) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 1, "stream": stream,
            field: make(server.vocab_size)}
    _assert_400(server.post("/v1/completions", body), field)
    server.assert_healthy()


# ----------------------------------------------------------------- 5. no 200-then-error

@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "(a|b"}, "guided_regex"),
    ({"guided_json": {"type": "objekt"}}, "guided_json"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
     "response_format"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_invalid_request_gets_its_4xx_status(server: Server, extra: dict, param: str,
                                                      route: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "stream": True, **extra}
    body.update({"prompt": "hi"} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "hi"}]})
    _assert_400(server.post(route, body), param)


# ----------------------------------------------------------------- 6. floats, caps

@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty"])
def test_non_finite_floats_are_400(server: Server, raw: str, field: str) -> None:
    body = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2, "{field}": {raw}}}'
    _assert_400(server.post("/v1/completions", body), field)


def test_logprobs_cap_is_max_logprobs(server: Server) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 21}
    _assert_400(server.post("/v1/chat/completions", chat), "top_logprobs")
    _assert_400(server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}),
                "logprobs")


def test_body_over_the_limit_is_413(server: Server) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * 200_000})
    response = server.post("/v1/completions", body)
    assert response.status_code == 413 and response.json()["error"]["message"]

    def chunks():  # no Content-Length: the body arrives chunked
        for _ in range(50):
            yield b" " * 4096
        yield body.encode()
    response = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    server.assert_healthy()


# ----------------------------------------------------------------- 7. nothing silently dropped

@pytest.mark.parametrize("route,extra,param", [
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stream": True, "stream_options": {"bogus": True}}, "stream_options"),
    # tool_choice defaults to "auto" with tools, which needs --enable-auto-tool-choice
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
])
def test_fields_that_would_change_the_answer_are_400(server: Server, route: str, extra: dict,
                                                     param: str) -> None:
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"prompt": "hi"} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "hi"}]})
    body.update(extra)
    _assert_400(server.post(route, body), param)


def test_best_of_equal_to_n_and_tools_off_are_accepted(server: Server) -> None:
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                        "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})
    assert r.status_code == 200


def test_continuous_usage_stats(server: Server) -> None:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 5, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    with_choices = [e for e in events if e["choices"]]
    assert with_choices and all(e["usage"] is not None for e in with_choices)
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


# ----------------------------------------------------------------- 8. a dead engine exits

def _descendants(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            kids += [int(child), *_descendants(int(child))]
    return kids


def test_dead_engine_fails_pending_requests_and_exits_nonzero(tiny_llama: Path) -> None:
    """Kill the worker process (an engine-wide fault): the pending request fails at once, the
    server answers 503 and exits with status 1."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", str(tiny_llama),
           "--dtype", "float32", "--kv-cache-memory-bytes", "4000000",
           "--distributed-executor-backend", "mp", "--port", str(port),
           "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        workers = _descendants(proc.pid)
        assert workers
        body = {"prompt": "ROMEO:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert any('"error"' in line for line in rest), rest[-3:]
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_too_long_to_fit_is_refused_before_tokenizing(server: Server, route: str) -> None:
    """A text far longer than max_model_len tokens could hold is refused by its length (fast, no
    memory spike); truncate_prompt_tokens still keeps the tail of a long text."""
    text = "All the world's a stage. " * 3000  # 75k characters, under the body limit
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"prompt": text} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": text}]})
    start = time.monotonic()
    _assert_400(server.post(route, body), "prompt" if route == "/v1/completions" else "messages")
    assert time.monotonic() - start < 2
    if route == "/v1/completions":
        r = server.post(route, {**body, "truncate_prompt_tokens": 20})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 20


def test_usage_reports_prefix_cache_hits(server: Server) -> None:
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache
    (a repeated prompt hits its full blocks; issue #17)."""
    body = {"model": MODEL, "prompt": [5 + i % 50 for i in range(40)], "max_tokens": 2,
            "temperature": 0}
    first = server.post("/v1/completions", body).json()["usage"]
    second = server.post("/v1/completions", body).json()["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] == 40
    assert second["prompt_tokens_details"]["cached_tokens"] == 32  # two full blocks of 16
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
