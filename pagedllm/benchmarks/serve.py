"""Serving benchmark: drive a running OpenAI-compatible server over HTTP with streamed requests.

Requests are sent at a Poisson `request_rate` (req/s; inf = all at once), at most
`max_concurrency` in flight, each a streamed POST /v1/completions with the prompt as token ids,
`max_tokens = output_len`, `ignore_eos`, greedy, and `stream_options.include_usage`. TTFT is the
time to the first non-empty chunk; TPOT = (latency - TTFT) / (completion_tokens - 1) with the
token count from the usage chunk, as vLLM's `benchmark_serving` does, because the server sends
only non-empty text deltas (a token that decodes to nothing arrives with a later chunk).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.benchmarks.report import percentiles
from pagedllm.benchmarks.workload import BenchRequest


@dataclass
class RequestRecord:
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0


async def fetch_served_model(client, base_url: str) -> tuple[str, str | None]:
    """(first served model id, its `root` (checkpoint path) or None) from GET /v1/models."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    card = resp.json()["data"][0]
    return card["id"], card.get("root")


async def _send(client, url: str, model: str, request: BenchRequest) -> RequestRecord:
    record = RequestRecord(prompt_tokens=len(request.prompt_token_ids))
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])
                    return record
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"].get("completion_tokens", 0)
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    if not record.chunk_times:
                        record.ttft_s = now - start
                    record.chunk_times.append(now)
        record.latency_s = time.perf_counter() - start
        record.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
        record.error = f"{type(e).__name__}: {e}"
    return record


async def run_serve_benchmark(base_url: str, requests: list[BenchRequest], request_rate: float,
                              max_concurrency: int | None = None, model: str | None = None,
                              seed: int = 0, api_key: str | None = None,
                              timeout_s: float = 3600.0) -> dict[str, Any]:
    """Send `requests` to the server at `base_url`; returns throughput and latency figures."""
    import httpx

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1,
                          max_keepalive_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                                 headers=headers) as client:
        if model is None:
            model, _ = await fetch_served_model(client, base_url)
        url = f"{base_url}/v1/completions"
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = random.Random(seed)

        async def limited(r: BenchRequest) -> RequestRecord:
            if semaphore is None:
                return await _send(client, url, model, r)
            async with semaphore:
                return await _send(client, url, model, r)

        tasks = []
        start = time.perf_counter()
        for i, r in enumerate(requests):
            if i and not math.isinf(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(limited(r)))
        records = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return serve_figures(records, elapsed, request_rate, max_concurrency, model)


def serve_figures(records: list[RequestRecord], elapsed_s: float, request_rate: float,
                  max_concurrency: int | None, model: str) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1)
            for r in ok if r.completion_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    errors = [r.error for r in records if not r.success]
    return {"backend": "pagedllm-server", "model": model,
            "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            "max_concurrency": max_concurrency, "num_requests": len(records),
            "num_successful": len(ok), "num_failed": len(errors),
            "first_errors": errors[:3], "elapsed_s": elapsed_s,
            "num_input_tokens": in_tokens, "num_output_tokens": out_tokens,
            "requests_per_s": len(ok) / elapsed_s, "output_tokens_per_s": out_tokens / elapsed_s,
            "total_tokens_per_s": (in_tokens + out_tokens) / elapsed_s,
            **percentiles([r.ttft_s for r in ok if r.chunk_times], "ttft_ms", 1e3),
            **percentiles(tpot, "tpot_ms", 1e3), **percentiles(itl, "itl_ms", 1e3),
            **percentiles([r.latency_s for r in ok], "e2e_latency_ms", 1e3)}
