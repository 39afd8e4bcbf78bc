"""--data-parallel-size 2: two engine replicas behind one server give the DP=1 greedy text."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.dp_async_llm import DataParallelAsyncLLM
from tests.entrypoints.openai.server_process import running_server
from tests.entrypoints.openai.test_openai_server import (API_KEY, ENGINE_FLAGS, ENGINE_KWARGS,
                                                         MODEL_NAME, Server)


@pytest.fixture(scope="module")
def dp_server(tiny_llama):
    args = ["--model", str(tiny_llama), "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
            "--data-parallel-size", "2", "--uvicorn-log-level", "warning", *ENGINE_FLAGS]
    with running_server(args) as (proc, url):
        yield Server(proc, int(url.rsplit(":", 1)[1]))


def test_dp2_matches_dp1(dp_server, tiny_llama):
    prompts = [f"Request number {i} says" for i in range(12)]
    offline = LLM(str(tiny_llama), **ENGINE_KWARGS).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    client = dp_server.async_client()

    async def run():
        return await asyncio.gather(*(client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0.0,
            extra_body={"ignore_eos": True}) for p in prompts))

    responses = asyncio.run(run())
    assert [r.choices[0].text for r in responses] == [o.outputs[0].text for o in offline]


def test_metrics_per_replica(dp_server):
    prompts = [f"Metric request {i}" for i in range(6)]
    for prompt in prompts:
        response = dp_server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt,
                                                      "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200
    text = httpx.get(dp_server.url + "/metrics", timeout=10).text
    for engine in ("0", "1"):       # a gauge series per replica, none overwriting the other
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f'pagedllm:{gauge}{{engine="{engine}",model_name="{MODEL_NAME}"}}' in text
    # Counters add up over both replicas: 3 tokens per request at least (earlier tests add more).
    assert dp_server.metric("pagedllm:generation_tokens_total") >= 3 * len(prompts)
    assert 'engine="' not in next(line for line in text.splitlines()
                                   if line.startswith("pagedllm:generation_tokens_total"))


def test_routing_balances_in_flight_requests():
    class Replica:  # the interface the router reads; no engine needed
        def __init__(self):
            self.dead_error = None
            self.tokenizer, self.max_model_len, self.vocab_size = None, 64, 10
            self.default_sampling_params = {}
            self.input_processor = None

    router = DataParallelAsyncLLM([Replica(), Replica(), Replica()])
    router._in_flight = [2, 0, 1]
    assert router.pick_replica() == 1
    router._in_flight = [1, 1, 1]
    assert router.pick_replica() == 0
    router.replicas[0].dead_error = RuntimeError("dead")
    assert router.pick_replica() == 1
