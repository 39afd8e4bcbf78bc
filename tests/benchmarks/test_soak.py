"""`pagedllm bench soak`: the request generator, the answer checks, failure detection against a
stub server, and soak runs against a real `pagedllm serve` (a short one by default, the full
2000 requests at concurrency 64 under `-m slow`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.benchmarks.soak import SoakConfig, rss_per_process, run_soak
from pagedllm.benchmarks.soak_cases import (CHAT, COMPLETIONS, DISCONNECT, DISCONNECT_MODES,
                                            INVALID, MAX_VALID_TOKENS, MUTATIONS, VALID,
                                            SoakCase, make_cases, num_warmup)
from pagedllm.benchmarks.soak_client import check_invalid, check_stream, check_valid
from pagedllm.benchmarks.soak_server import (ManagedServer, ProcessRss, free_port, loopback_url,
                                             parse_metrics, process_rss_bytes,
                                             process_tree_rss)

VOCAB = 4096


def _strict_json(raw: bytes) -> dict:
    def no_constant(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(raw, parse_constant=no_constant)


# ------------------------------------------------------------------ the generator
def test_cases_are_deterministic_for_a_seed():
    first = make_cases(400, 7, VOCAB, "m")
    assert first == make_cases(400, 7, VOCAB, "m")
    assert [c.body for c in first] != [c.body for c in make_cases(400, 8, VOCAB, "m")]


def test_mix_warmup_and_coverage():
    cases = make_cases(2000, 0, VOCAB, "m")
    warmup = num_warmup(len(cases))
    assert warmup == 200 and all(c.kind == VALID for c in cases[:warmup])
    kinds = Counter(c.kind for c in cases[warmup:])
    assert 0.55 < kinds[VALID] / 1800 < 0.65 and 0.2 < kinds[INVALID] / 1800 < 0.3
    assert 0.1 < kinds[DISCONNECT] / 1800 < 0.2
    assert {c.label for c in cases if c.kind == INVALID} == {m.label for m in MUTATIONS}
    assert {c.category for c in cases if c.kind == DISCONNECT} == set(DISCONNECT_MODES)
    assert {c.path for c in cases} == {COMPLETIONS, CHAT}
    assert any(c.stream for c in cases) and any(not c.stream for c in cases)


def test_every_invalid_case_names_what_it_breaks():
    for case in make_cases(2000, 0, VOCAB, "m"):
        if case.kind != INVALID:
            continue
        assert case.expect_status and all(400 <= s < 500 for s in case.expect_status)
        assert case.expect_params, case.label
        if case.category in ("malformed_json", "oversized_body"):
            continue
        body = json.loads(case.body)  # Python's parser reads the NaN / Infinity cases too
        assert case.category in body, (case.label, case.summary())
        assert all(p in body for p in case.expect_params if p is not None), case.label


def test_valid_cases_are_in_range_and_count_their_choices():
    for case in make_cases(1000, 3, VOCAB, "m"):
        if case.kind == INVALID:
            continue
        body = _strict_json(case.body)
        assert body["stream"] is case.stream and body["model"] == "m"
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        assert 1 <= max_tokens <= MAX_VALID_TOKENS and 1 <= body["n"] <= 4
        assert all(0 <= t < VOCAB for t in body.get("stop_token_ids", []))
        if case.path == COMPLETIONS:
            prompt = body["prompt"]
            prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) \
                else [prompt]
            flat = [t for p in prompts if isinstance(p, list) for t in p]
            assert all(3 <= t < VOCAB for t in flat)
            assert case.num_choices == body["n"] * len(prompts)
        else:
            assert case.num_choices == body["n"]
        assert case.include_usage == bool(body.get("stream_options", {}).get("include_usage"))


def test_skip_and_no_chat():
    cases = make_cases(500, 0, VOCAB, "m", chat=False, skip=("n=", "raw_"))
    assert {c.path for c in cases} == {COMPLETIONS}
    assert not any(c.label.startswith("n=") or c.label.startswith("raw_") for c in cases)
    only_valid = make_cases(300, 0, VOCAB, "m", skip=("",))
    assert {c.kind for c in only_valid} == {VALID}


# ------------------------------------------------------------------ the checks
def _case(kind: str = VALID, stream: bool = True, num_choices: int = 2, **kw) -> SoakCase:
    return SoakCase(0, kind, kw.pop("category", "x"), "x", COMPLETIONS, b"{}", stream,
                    num_choices=num_choices, **kw)


def _chunk(index: int, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": index, "text": "a", "finish_reason": finish}]})


def test_stream_checks():
    case = _case(include_usage=True)
    good = [_chunk(0), _chunk(1, "length"), _chunk(0, "stop"), '{"choices": [], "usage": {}}',
            "[DONE]"]
    assert check_stream(case, good[:3] + ['{"choices": [], "usage": {"total_tokens": 3}}',
                                          "[DONE]"], complete=True) == []
    checks = [c for c, _ in check_stream(case, good[:2] + ["[DONE]"], complete=True)]
    assert checks == ["valid_completed", "valid_completed"]  # choice 0 unfinished, no usage
    error = '{"error": {"message": "boom", "type": "server_error", "param": null, "code": null}}'
    assert [c for c, _ in check_stream(case, [_chunk(0), error], complete=False)] == \
        ["stream_error_event"]
    assert check_stream(case, [_chunk(0)], complete=False) == []  # a disconnect mid-stream
    assert [c for c, _ in check_valid(case, 503, b"", ["x"])] == ["no_5xx"]


def test_non_streamed_valid_checks():
    case = _case(stream=False)
    ok = json.dumps({"choices": [{"index": 1, "finish_reason": "stop"},
                                 {"index": 0, "finish_reason": "length"}]}).encode()
    assert check_valid(case, 200, ok, None) == []
    short = json.dumps({"choices": [{"index": 0, "finish_reason": "stop"}]}).encode()
    assert check_valid(case, 200, short, None)[0][0] == "valid_completed"
    assert check_valid(case, 400, b"{}", None)[0][0] == "valid_completed"


def _error(param: str | None, status_body: dict | None = None) -> bytes:
    return json.dumps(status_body or {"error": {"message": "bad", "type": "invalid_request_error",
                                                "param": param, "code": None}}).encode()


def test_invalid_checks():
    case = _case(INVALID, expect_status=(400,), expect_params=("top_p",))
    assert check_invalid(case, 400, _error("top_p"), None) == []
    assert [c for c, _ in check_invalid(case, 400, _error("temperature"), None)] == \
        ["error_param"]
    assert [c for c, _ in check_invalid(case, 400, b'{"detail": "bad"}', None)] == \
        ["error_object"]
    assert [c for c, _ in check_invalid(case, 422, _error("top_p"), None)] == \
        ["invalid_rejected"]
    assert [c for c, _ in check_invalid(case, 500, _error(None), None)] == ["no_5xx"]
    assert [c for c, _ in check_invalid(case, 200, b"", [_chunk(0, "stop"), "[DONE]"])] == \
        ["invalid_rejected"]
    streamed_error = ['{"error": {"message": "bad", "type": "invalid_request_error", '
                      '"param": "top_p", "code": null}}', "[DONE]"]
    assert [c for c, _ in check_invalid(case, 200, b"", streamed_error)] == \
        ["invalid_stream_status"]


def test_loopback_and_metrics_parsing():
    assert loopback_url("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert loopback_url("http://localhost:9") == ("localhost", 9)
    for url in ("http://10.1.2.3:8000", "https://127.0.0.1:8000", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            loopback_url(url)
    text = ('# HELP x\npagedllm:num_requests_running{model_name="a"} 2.0\n'
            'pagedllm:num_requests_running{model_name="b"} 1.0\n'
            'pagedllm:kv_cache_usage_perc{model_name="a"} 0.0\n')
    assert parse_metrics(text) == {"pagedllm:num_requests_running": 3.0,
                                   "pagedllm:kv_cache_usage_perc": 0.0}


# ------------------------------------------------------------------ against a stub server
@pytest.fixture
def careless_server() -> Iterator[str]:
    """A server that answers every POST 200 with one finished choice (never an error)."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": "stub", "root": None}]})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("".join(f'pagedllm:{g}{{model_name="stub"}} 0.0\n' for g in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")))

    @app.post("/v1/{path:path}")
    async def answer(path: str, request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_soak_reports_a_careless_server(careless_server: str):
    config = SoakConfig(num_requests=120, concurrency=8, request_timeout_s=10,
                        idle_timeout_s=1, skip=("MiB",))
    result = asyncio.run(run_soak(careless_server, config, time.monotonic() + 60, None,
                                  vocab_size=VOCAB))
    assert not result["passed"]
    assert result["requests_sent"] == 120 and result["requests_not_sent"] == 0
    failed = result["failed_checks"]
    assert failed["invalid_rejected"] == result["invalid_sent"]
    assert failed["valid_completed"] > 0  # n > 1, several prompts, streams without SSE
    assert "no_5xx" not in failed and "server_alive" not in failed
    assert result["end_state"]["idle"] and "note" in result["server_rss"]
    rows = result["failures"]
    assert all(r["request"].startswith("POST /v1/") for r in rows if r["index"] is not None)


# ------------------------------------------------------------------ RSS of a process tree
_BALLAST_MIB = 64


def test_rss_is_summed_over_the_process_tree():
    """A launcher whose memory sits in a grandchild (as a server's sits in its engine-core
    and API-server processes): the tree's RSS counts it, per process and summed, and kill()
    ends the whole tree."""
    ballast = (f"import time; b = b'x' * ({_BALLAST_MIB} << 20); print('ready', flush=True); "
               f"time.sleep(60)")
    script = f"sleep 60 & ( {sys.executable} -c \"{ballast}\" & wait ) & wait"
    server = ManagedServer([])
    server.proc = subprocess.Popen(["sh", "-c", script], start_new_session=True,
                                   stdout=subprocess.PIPE)
    try:
        assert server.proc.stdout.readline().strip() == b"ready"
        tree = server.rss_by_process()
        pids = [p.pid for p in tree]
        assert len(tree) == 4 and pids[0] == server.proc.pid, tree  # sh, sleep, sh, python
        assert all(p.ppid in pids for p in tree[1:]) and tree[0].ppid == 0
        ballast_proc = max(tree, key=lambda p: p.rss_bytes)
        assert ballast_proc.ppid != server.proc.pid           # a grandchild
        assert ballast_proc.rss_bytes > _BALLAST_MIB << 20
        assert process_rss_bytes(server.proc.pid) < (_BALLAST_MIB << 20) // 4  # the launcher
        total = server.rss_bytes()
        assert abs(total - sum(p.rss_bytes for p in tree)) < 4 << 20
    finally:
        server.kill()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and process_tree_rss(pid) for pid in pids):
        assert time.monotonic() < deadline, "kill() left part of the tree running"
        time.sleep(0.05)
    assert server.rss_bytes() is None and server.rss_by_process() == []


def test_rss_per_process_rows_follow_processes_by_pid():
    mib = 1 << 20
    warm = [ProcessRss(10, 0, "python3", 100 * mib), ProcessRss(11, 10, "python3", 50 * mib)]
    end = [ProcessRss(10, 0, "python3", 110 * mib), ProcessRss(12, 10, "python3", 20 * mib)]
    assert rss_per_process(warm, end) == [
        {"pid": 10, "name": "python3", "after_warmup_mib": 100.0, "end_mib": 110.0},
        {"pid": 11, "name": "python3", "after_warmup_mib": 50.0, "end_mib": None},
        {"pid": 12, "name": "python3", "after_warmup_mib": None, "end_mib": 20.0}]


# ------------------------------------------------------------------ against `pagedllm serve`
def _soak(tmp_path: Path, *flags: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "soak.json"
    args = parser.parse_args(["bench", "soak", *flags, "--output-json", str(out)])
    rc = args.func(args)
    return rc, json.loads(out.read_text())["results"][0]


def _assert_passed(rc: int, result: dict, num_requests: int) -> None:
    failures = "\n".join(f"[{r['check']}] {r['label']}: {r['request'][:200]} -> "
                         f"{r['detail'][:300]}" for r in result["failures"][:20])
    assert rc == 0 and result["passed"], failures
    assert result["requests_sent"] == num_requests
    assert result["valid_completed"] == result["valid_sent"] > 0
    assert result["invalid_sent"] > 0 and result["disconnects_sent"] > 0
    assert result["end_state"]["idle"] and result["end_state"]["num_preemptions"] > 0
    assert result["kv_capacity"]["tokens"] > 0 and result["server_stop"] is not None


@pytest.mark.slow
def test_short_soak_passes(tmp_path: Path):
    # About 25 s here (2 cores): start-up 5 s, requests 12-16 s, shutdown 5 s.
    rc, result = _soak(tmp_path, "--num-requests", "150", "--concurrency", "16",
                       "--max-duration-s", "120")
    _assert_passed(rc, result, 150)


@pytest.mark.slow
def test_full_soak_passes(tmp_path: Path):
    rc, result = _soak(tmp_path, "--num-requests", "2000", "--concurrency", "64")
    _assert_passed(rc, result, 2000)
