"""The development-mode routes (entrypoints/openai/dev_routes.py) on a tiny Llama, app in-process:
absent unless dev mode is on; /sleep and /wake_up (generation refused with 503 while asleep, the
same tokens after), /pause in its three modes and /resume, /update_weights (another
checkpoint's weights change the tokens, one of other shapes is refused with 400 and the old
weights keep serving) and /collective_rpc."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app
from tests.fixtures.checkpoints import make_tiny_checkpoint

MODEL = "tiny"
PROMPT = [5, 17, 99, 42, 7, 3, 61]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("dev_routes")
    other = make_tiny_checkpoint(root / "seed1", "LlamaForCausalLM", tiny_llama, seed=1)
    wider = make_tiny_checkpoint(root / "wide", "LlamaForCausalLM", tiny_llama, seed=2,
                                 intermediate_size=96)
    async_llm = AsyncLLM.from_engine_args(str(tiny_llama), dtype="float32",
                                          kv_cache_memory_bytes=4 << 20, max_num_seqs=4,
                                          enable_sleep_mode=True)
    client = TestClient(build_app(async_llm, [MODEL], dev_mode=True))
    client.__enter__()
    yield client, async_llm, str(tiny_llama), str(other), str(wider)
    client.__exit__(None, None, None)


def _complete(client, max_tokens: int = 6):
    return client.post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True})


def _token_ids(response) -> str:
    """The completion's text (greedy: the same text, the same tokens)."""
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_routes_exist_only_in_dev_mode(server):
    _, async_llm, *_ = server
    paths = {r.path for r in build_app(async_llm, [MODEL], dev_mode=False).routes}
    assert "/sleep" not in paths and "/update_weights" not in paths
    paths = {r.path for r in build_app(async_llm, [MODEL], dev_mode=True).routes}
    assert {"/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
            "/update_weights", "/collective_rpc"} <= paths


def test_sleep_and_wake_up(server):
    client, *_ = server
    want = _token_ids(_complete(client))
    for level in (1, 2):
        assert client.post(f"/sleep?level={level}").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        refused = _complete(client)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_sleeping"
        assert client.post("/wake_up").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _token_ids(_complete(client)) == want
    assert client.post("/sleep?level=5").status_code == 400


def _in_thread(fn):
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", fn()))
    thread.start()
    return thread, result


def _wait_running(async_llm) -> None:
    deadline = time.monotonic() + 30
    while not async_llm.engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_pause_modes(server):
    client, async_llm, *_ = server
    want = _token_ids(_complete(client))
    assert client.post("/pause?mode=sideways").status_code == 400

    # keep: a request sent while paused waits for the resume, then runs as usual.
    assert client.post("/pause?mode=keep").status_code == 200
    assert client.get("/is_paused").json() == {"is_paused": True}
    thread, result = _in_thread(lambda: _complete(client))
    thread.join(0.5)
    assert thread.is_alive()
    assert client.post("/resume").status_code == 200
    thread.join(30)
    assert _token_ids(result["r"]) == want

    # abort: the running request ends at once with finish_reason "abort".
    thread, result = _in_thread(lambda: _complete(client, max_tokens=1000))
    _wait_running(async_llm)
    assert client.post("/pause?mode=abort").status_code == 200
    thread.join(30)
    body = result["r"].json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 1000

    # While paused, sleep needs no waiting; wait: the pause returns once the request finished.
    assert client.post("/resume").status_code == 200
    thread, result = _in_thread(lambda: _complete(client, max_tokens=40))
    _wait_running(async_llm)
    assert client.post("/pause?mode=wait").status_code == 200
    thread.join(30)   # (the engine finished it; its response may still be on its way)
    assert result["r"].json()["choices"][0]["finish_reason"] == "length"
    assert client.post("/resume").status_code == 200
    assert client.get("/is_paused").json() == {"is_paused": False}


def test_update_weights_and_collective_rpc(server):
    client, _, base, other, wider = server
    want = _token_ids(_complete(client))
    assert client.post("/update_weights", json={"model_path": other}).status_code == 200
    got_other = _token_ids(_complete(client))
    assert got_other != want
    refused = client.post("/update_weights", json={"model_path": wider})
    assert refused.status_code == 400 and "do not fit" in refused.json()["error"]["message"]
    assert _token_ids(_complete(client)) == got_other
    assert client.post("/update_weights", json={"model_path": base}).status_code == 200
    assert _token_ids(_complete(client)) == want

    rpc = client.post("/collective_rpc", json={"method": "kv_cache_windows"})
    assert rpc.status_code == 200 and rpc.json() == {"results": [[None]]}
    assert client.post("/collective_rpc", json={"method": "__init__"}).status_code == 400



def test_lone_surrogates_in_bodies_are_400s(server):
    # A lone UTF-16 surrogate is valid JSON; in a model path or a method name it reached code
    # that echoes or encodes it. Refused as every generation route refuses it (400 naming the
    # field), and the server goes on.
    client, *_ = server
    bad = '"a\\ud800b"'
    for path, body, field in (("/update_weights", '{"model_path": %s}' % bad, "model_path"),
                              ("/collective_rpc", '{"method": %s}' % bad, "method")):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == field, (path, r.text)
    assert _token_ids(_complete(client))
