"""Prefill/decode disaggregation over HTTP: `pagedllm serve` as kv_producer and as kv_consumer
(P2pShmConnector) behind `pagedllm proxy` answer as one server does (the decode instance asked
directly, without kv_transfer_params), for completions and chat, greedy and seeded, streamed and
not; once the prefill instance is killed, the requests that need it fail with an error and the
decode instance serves the others. (The engine-level twin, tests/engine/test_pd_disagg.py, is
the fast one.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.engine.test_pd_disagg import transfer_files
from tests.entrypoints.openai.server_process import free_port, running_server

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--block-size", "16", "--max-num-seqs", "4"]
PROMPTS = ["the quick brown fox jumps over the lazy dog and then", "hello", "a b c d e f g h i j "
           "k l m n o p q r s t u v w x y z"]


def _transfer(role: str, port: int, shm) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "P2pShmConnector", "kv_role": role, "kv_port": port,
        "kv_connector_extra_config": {"shm_dir": str(shm), "transfer_timeout": 2}})]


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    shm = tmp_path_factory.mktemp("shm")
    kv_port = free_port()
    model = ["--model", str(tiny_llama), *ENGINE]
    with running_server([*model, *_transfer("kv_producer", kv_port, shm)]) as (prefill, p_url), \
            running_server([*model, *_transfer("kv_consumer", kv_port, shm)]) as (_, d_url):
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "proxy",
                                  "--prefill", p_url, "--decode", d_url, "--port", str(port)],
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proxy.poll() is None and time.monotonic() < deadline
                time.sleep(0.25)
            yield {"prefill": prefill, "prefill_url": p_url, "decode_url": d_url,
                   "proxy_url": url, "shm": shm}
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(timeout=30)
            if prefill.poll() is not None:   # (killed by the last test: skip the exit check)
                prefill.returncode = 0


def _body(route: str, prompt: str, sampling: dict, stream: bool) -> dict:
    body = {"model": None, "max_tokens": 8, "ignore_eos": True, "stream": stream, **sampling}
    if route == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return body


def _text(route: str, response: httpx.Response, stream: bool) -> str:
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        return choice["text"] if route == "/v1/completions" else choice["message"]["content"]
    parts = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content")
                             or "")
    return "".join(parts)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_proxy_answers_as_one_server(servers, route):
    texts = []
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        for stream in (False, True):
            for prompt in PROMPTS:
                body = _body(route, prompt, sampling, stream)
                want = _text(route, httpx.post(servers["decode_url"] + route, json=body,
                                               timeout=60), stream)
                got = httpx.post(servers["proxy_url"] + route, json=body, timeout=60)
                assert _text(route, got, stream) == want, (sampling, stream, prompt)
                texts.append(want)
                if not stream:
                    usage = got.json()["usage"]
                    # The decode instance loaded every prompt token but the last.
                    assert usage["prompt_tokens_details"]["cached_tokens"] \
                        == usage["prompt_tokens"] - 1
    assert sum(map(bool, texts)) > len(texts) // 2   # (not a comparison of empty answers)
    assert transfer_files(servers["shm"]) == []


def test_prefill_killed_fails_those_requests(servers):
    route = "/v1/completions"
    body = _body(route, PROMPTS[0], {"temperature": 0.0}, False)
    handshake = httpx.post(servers["prefill_url"] + route, timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = handshake["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    servers["prefill"].send_signal(signal.SIGKILL)
    servers["prefill"].wait(timeout=30)
    for stream in (False, True):
        failed = httpx.post(servers["decode_url"] + route, timeout=60,
                            json={**body, "stream": stream, "kv_transfer_params": params})
        text = failed.text
        assert failed.status_code != 200 or "error" in text, text
        assert "KV transfer failed" in text and "did not answer" in text, text
    # The decode instance goes on; the proxy reports the dead prefill instance.
    ok = httpx.post(servers["decode_url"] + route, json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    assert httpx.post(servers["proxy_url"] + route, json=body, timeout=60).status_code == 502
