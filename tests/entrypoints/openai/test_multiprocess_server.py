"""`pagedllm serve --multiprocess-mode -dp 2`: two engine-core processes behind one server give the
single in-process replica's greedy text (plain and streamed); SIGKILL of one replica's core
process fails its in-flight request with an error and the server exits with status 1.

Slow: the server and its two core processes take a while to start on a small machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.openai.server_process import free_port, running_server, wait_healthy
from tests.entrypoints.openai.test_openai_server import (API_KEY, ENGINE_FLAGS, ENGINE_KWARGS,
                                                         MODEL_NAME, Server)

pytestmark = pytest.mark.slow


def _core_processes(server_pid: int) -> list[int]:
    """The server's engine-core processes (its children started by multiprocessing's spawn,
    not its resource tracker)."""
    pids = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                pids.append(int(child))
    return pids


@pytest.fixture(scope="module")
def mp_server(tiny_llama):
    args = ["--model", str(tiny_llama), "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
            "--multiprocess-mode", "--data-parallel-size", "2",
            "--uvicorn-log-level", "warning", *ENGINE_FLAGS]
    with running_server(args) as (proc, url):
        yield Server(proc, int(url.rsplit(":", 1)[1]))


def test_dp2_processes_match_single_replica(mp_server, tiny_llama):
    assert len(_core_processes(mp_server.proc.pid)) == 2
    prompts = [f"Request number {i} says" for i in range(12)]
    offline = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    client = mp_server.async_client()

    async def run():
        return await asyncio.gather(*(client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0.0,
            extra_body={"ignore_eos": True}) for p in prompts))

    responses = asyncio.run(run())
    assert [r.choices[0].text for r in responses] == [o.outputs[0].text for o in offline]
    with httpx.stream("POST", mp_server.url + "/v1/completions", headers=mp_server.auth,
                      timeout=60, json={"model": MODEL_NAME, "prompt": prompts[0],
                                        "max_tokens": 12, "temperature": 0, "stream": True,
                                        "ignore_eos": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == offline[0].outputs[0].text
    # Per-replica gauges from the stats each core process sends with its outputs.
    text = httpx.get(mp_server.url + "/metrics", timeout=10).text
    for engine in ("0", "1"):
        assert f'pagedllm:num_requests_running{{engine="{engine}",model_name="{MODEL_NAME}"}}' \
            in text
    assert mp_server.metric("pagedllm:generation_tokens_total") >= 12 * (len(prompts) + 1)


def test_sigkill_of_a_replica_fails_its_requests_and_exits_nonzero(tiny_llama):
    """Two streams, one per replica (round robin); SIGKILL one replica's core process: its stream
    ends with an error within seconds and the server exits with status 1."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", str(tiny_llama),
           "--multiprocess-mode", "--data-parallel-size", "2",
           "--data-parallel-routing-policy", "round_robin", "--port", str(port),
           "--uvicorn-log-level", "warning", *ENGINE_FLAGS]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        cores = _core_processes(proc.pid)
        assert len(cores) == 2
        body = {"prompt": "ROMEO:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as first, \
                httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as second:
            assert first.status_code == second.status_code == 200
            streams = [first.iter_lines(), second.iter_lines()]
            for lines in streams:
                next(lines)
            os.kill(min(cores), signal.SIGKILL)
            start = time.monotonic()
            rest = [list(lines) for lines in streams]
        assert time.monotonic() - start < 10
        assert any('"error"' in line for lines in rest for line in lines), rest
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
