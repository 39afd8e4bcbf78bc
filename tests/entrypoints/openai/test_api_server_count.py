"""`pagedllm serve --api-server-count 2`: two API-server processes on one port, over one engine
core process: both serve (the kernel spreads connections over them), the outputs are the
in-process engine's, the gauges (sent by the core) agree, and SIGTERM ends all with status 0.

Slow: three processes load the model on a small machine.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.openai.server_process import running_server
from tests.entrypoints.openai.test_openai_server import ENGINE_FLAGS, ENGINE_KWARGS

pytestmark = pytest.mark.slow


def test_two_api_servers_both_serve_one_core(tiny_llama):
    prompts = [f"Request number {i} says" for i in range(32)]
    offline = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
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
        # Each API server counts the requests it served; new connections reach both.
        totals, running = set(), set()
        for _ in range(40):
            text = httpx.get(url + "/metrics", timeout=30).text
            totals.add(float(re.search(
                r'request_success_total\{finished_reason="length"[^}]*\} (\S+)', text)[1]))
            running.add(float(re.search(r"num_requests_running\{[^}]*\} (\S+)", text)[1]))
            if len(totals) == 2:
                break
        assert len(totals) == 2 and sum(totals) == len(prompts) and min(totals) > 0, totals
        assert running == {0.0}
