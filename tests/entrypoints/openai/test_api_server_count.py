"""`pagedllm serve --api-server-count 2`: two API-server processes on one port, over one engine
core process: both serve (the kernel spreads connections over them), the outputs are the
in-process engine's, /metrics of either is the whole server's (counters summed, gauges
current), and SIGTERM ends all with status 0 and removes the metrics folder; so does SIGTERM to
the whole process group (systemd's stop), with no ERROR logged and nothing left behind.
With `-dp 2`: the same text, and SIGKILL of one core stops the pool with status 1.

Slow: three processes load the model on a small machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from pagedllm import LLM, SamplingParams
from tests.entrypoints.openai.server_process import free_port, running_server, wait_healthy
from tests.entrypoints.openai.test_openai_server import ENGINE_FLAGS, ENGINE_KWARGS

pytestmark = pytest.mark.slow


def _metric(url: str, sample: str) -> float:
    """One sample of a fresh scrape (a new connection: any API server may answer)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(re.escape(sample).replace(r"\*", "[^}]*") + r" (\S+)", text)
    assert len(found) == 1, (sample, found)
    return float(found[0])


def _served_by_pid(folder: Path) -> dict[int, float]:
    """Requests each API server counted, from its own file in the metrics folder."""
    return {int(path.stem.split("_")[1]): sum(
        s.value for metric in MultiProcessCollector.merge([str(path)]) for s in metric.samples
        if s.name == "pagedllm:request_success_total") for path in folder.glob("counter_*.db")}


def test_two_api_servers_one_core_one_metrics(tiny_llama):
    """Both API servers serve (the kernel spreads connections over them), the text is the
    in-process engine's, and /metrics of either is the whole server's: counters add up to the
    requests sent (the per-process files show both counted some), the core's counters are not
    counted twice, and the engine gauges are current whichever API server answers (before,
    each showed the state of its own last step: an API server without requests showed 0
    running while the other streamed). The metrics folder is gone after SIGTERM."""
    prompts = [f"Request number {i} says" for i in range(32)]
    llm = LLM(str(tiny_llama), **ENGINE_KWARGS)
    offline = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)
    prefix_queries = llm.get_stats().prefix_cache_stats.queries
    args = ["--model", str(tiny_llama), "--api-server-count", "2",
            "--uvicorn-log-level", "warning", *ENGINE_FLAGS]
    with running_server(args, startup_timeout_s=600) as (proc, url):
        async def one(prompt: str) -> str:
            # A connection of its own each: SO_REUSEPORT picks the API server per connection.
            async with httpx.AsyncClient(timeout=120) as client:
                r = await client.post(url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

        async def run():
            return await asyncio.gather(*(one(p) for p in prompts))

        assert asyncio.run(run()) == [o.outputs[0].text for o in offline]
        for _ in range(8):      # whichever API server answers
            assert _metric(url, "pagedllm:request_success_total{finished_reason=\"length\"*}"
                           ) == len(prompts)
            assert _metric(url, "pagedllm:generation_tokens_total{*}") == 6 * len(prompts)
            assert _metric(url, "pagedllm:prompt_tokens_total{*}") == sum(
                len(o.prompt_token_ids) for o in offline)
            assert _metric(url, "pagedllm:prefix_cache_queries_total{*}") == prefix_queries
            assert _metric(url, "pagedllm:num_requests_running{*}") == 0
        # One stream on one API server: every scrape, through either, sees it running.
        body = {"prompt": "ROMEO:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            for _ in range(3):
                next(lines)
            running = [_metric(url, "pagedllm:num_requests_running{*}") for _ in range(8)]
            assert running == [1.0] * 8, running
        deadline = time.monotonic() + 30
        while _metric(url, "pagedllm:num_requests_running{*}") != 0:
            assert time.monotonic() < deadline, "the gauge kept the closed stream"
            time.sleep(0.2)
        assert [_metric(url, "pagedllm:num_requests_running{*}") for _ in range(8)] == [0] * 8
        # Both API servers counted some of the requests (their own files in the folder).
        folders = {pid: _environ(pid).get("PROMETHEUS_MULTIPROC_DIR")
                   for pid in _pool_children(proc.pid)}
        api_servers = [pid for pid, folder in folders.items() if folder]
        assert len(api_servers) == 2 and len(folders) == 3, folders   # and one core
        folder = Path(folders[api_servers[0]])
        assert folders[api_servers[1]] == str(folder)
        served = _served_by_pid(folder)
        assert sorted(served) == sorted(api_servers) and min(served.values()) > 0, served
        assert sum(served.values()) == len(prompts) + 1      # and the stream (aborted)
    assert not folder.exists()


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").partition("=")[::2] for p in pairs if p)


def _pool_children(launcher_pid: int) -> list[int]:
    """The launcher's engine-core and API-server processes (multiprocessing spawn children)."""
    pids = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
    return sorted(pids)


def test_dp2_pool_and_a_killed_core_stops_everything(tiny_llama):
    """`-dp 2 --api-server-count 2`: two cores on disjoint CPUs, two API servers, greedy text
    as in-process; SIGKILL of one core ends the in-flight streams it served with an error, and
    every process of the pool is gone with the launcher's status 1 (nothing hangs)."""
    prompts = [f"Request number {i} says" for i in range(8)]
    offline = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                             "--model", str(tiny_llama), "--api-server-count", "2", "-dp", "2",
                             "--data-parallel-routing-policy", "round_robin",
                             "--port", str(port), "--uvicorn-log-level", "warning",
                             *ENGINE_FLAGS], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(proc, url, 600, poll_s=0.5)
        children = _pool_children(proc.pid)
        assert len(children) == 4, children   # 2 cores (spawned first), 2 API servers
        if len(os.sched_getaffinity(0)) >= 2 and "PAGEDLLM_CPU_THREADS" not in os.environ:
            bound = [os.sched_getaffinity(pid) for pid in children[:2]]
            assert not bound[0] & bound[1], bound    # each core its own share of the CPUs
        texts = [httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        ).json()["choices"][0]["text"] for p in prompts]
        assert texts == [o.outputs[0].text for o in offline]
        body = {"prompt": "ROMEO:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with contextlib.ExitStack() as stack:
            streams = [stack.enter_context(httpx.stream("POST", url + "/v1/completions",
                                                        json=body, timeout=60))
                       for _ in range(4)]
            lines = [s.iter_lines() for s in streams]
            for it in lines:
                next(it)
            os.kill(children[0], signal.SIGKILL)
            start = time.monotonic()
            rest = [list(it) for it in lines]
        assert time.monotonic() - start < 60
        assert any('"error"' in line for r in rest for line in r), rest
        assert proc.wait(timeout=90) == 1
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or \
                Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_sigterm_to_the_process_group_is_a_clean_shutdown(tiny_llama, tmp_path):
    """systemd's stop (`kill -TERM -<pgid>`) reaches the launcher, both API servers and the
    core at once: the request in flight finishes, the pool exits 0 with no ERROR line or
    traceback (the core outlives the API servers: it ignores SIGTERM and stops when the
    launcher closes its stop pipe), no process of the group is left, and the temporary folders
    (IPC sockets, metrics) are gone. (A core's SIGKILL is an engine death: the test above.)"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    log = tmp_path / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                                 "--model", str(tiny_llama), "--api-server-count", "2",
                                 "--port", str(port), "--uvicorn-log-level", "warning",
                                 *ENGINE_FLAGS],
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)},
                                stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
    try:
        wait_healthy(proc, url, 600, poll_s=0.5)
        assert len(_pool_children(proc.pid)) == 3
        assert len(_group_members(proc.pid)) >= 4       # launcher, core, 2 API servers
        in_flight: list[httpx.Response] = []
        request = threading.Thread(target=lambda: in_flight.append(httpx.post(
            url + "/v1/completions", timeout=120, json={
                "prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True})))
        request.start()
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        request.join(60)
        assert in_flight and in_flight[0].status_code == 200, in_flight
        assert in_flight[0].json()["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 10
        while _group_members(proc.pid):
            assert time.monotonic() < deadline, _group_members(proc.pid)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    assert "ERROR" not in text and "Traceback" not in text and "leaked" not in text, text
    assert list(tmp.iterdir()) == []
