"""The OpenAI-compatible server end to end: a real server process, the official `openai` client.

One server (module scope) on a free loopback port over the tiny Llama checkpoint, with an API key;
greedy results are checked against the offline `LLM` on the same checkpoint and settings.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import transformers

from pagedllm import LLM, SamplingParams
from tests.entrypoints.openai.server_process import running_server

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "16000000", "--seed", "0"]
ENGINE_KWARGS = {"dtype": "float32", "kv_cache_memory_bytes": 16_000_000, "seed": 0}
PROMPTS = [f"Prompt number {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(32)]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"
        self.auth = {"Authorization": f"Bearer {API_KEY}"}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def post(self, path: str, body: dict | str | bytes,
             headers: dict | None = None) -> httpx.Response:
        headers = self.auth if headers is None else headers
        if isinstance(body, (str, bytes)):
            return httpx.post(self.url + path, content=body, timeout=60,
                              headers={**headers, "Content-Type": "application/json"})
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60)

    def metric(self, name: str, labels: str = "") -> float:
        """Value of one sample of /metrics (`labels`: a substring of its label set)."""
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    args = ["--model", str(tiny_llama), "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
            "--uvicorn-log-level", "warning", *ENGINE_FLAGS]
    with running_server(args) as (proc, url):
        yield Server(proc, int(url.rsplit(":", 1)[1]))


@pytest.fixture(scope="module")
def offline_llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), **ENGINE_KWARGS)


def test_health_models_and_auth(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)


def test_completion_stream_equals_non_stream(server: Server, offline_llm: LLM) -> None:
    client = server.client()
    prompt, max_tokens = "The capital of France is", 24
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert abs(full.created - time.time()) < 120
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    n_prompt = len(offline_llm.get_tokenizer()(prompt).input_ids)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens,
            full.usage.total_tokens) == (n_prompt, max_tokens, n_prompt + max_tokens)

    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == max_tokens
    assert len({c.id for c in chunks}) == 1

    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True), use_tqdm=False)
    assert choice.text == offline[0].outputs[0].text


def test_completion_prompt_forms_and_echo(server: Server, offline_llm: LLM) -> None:
    client = server.client()
    tokenizer = offline_llm.get_tokenizer()
    ids = tokenizer("Hello there").input_ids
    common = dict(model=MODEL_NAME, max_tokens=6, temperature=0.0)
    by_text = client.completions.create(prompt="Hello there", **common).choices[0].text
    by_ids = client.completions.create(prompt=ids, **common).choices[0].text
    assert by_ids == by_text
    batch = client.completions.create(prompt=["Hello there", "Bye"], **common)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text
    id_batch = client.completions.create(prompt=[ids, ids], **common)
    assert [c.text for c in id_batch.choices] == [by_text, by_text]
    echoed = client.completions.create(prompt="Hello there", echo=True, **common)
    assert echoed.choices[0].text == "Hello there" + by_text


def test_chat_stream_and_non_stream(server: Server, offline_llm: LLM) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                          max_completion_tokens=12, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    offline = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True), use_tqdm=False)
    assert full.choices[0].message.content == offline[0].outputs[0].text
    assert full.usage.prompt_tokens == len(offline[0].prompt_token_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_sampling_fields_are_applied(server: Server) -> None:
    client = server.client()
    common = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16)
    seeded = [client.completions.create(**common, temperature=1.0, top_p=0.9, seed=7,
                                        extra_body={"top_k": 20, "min_p": 0.01}).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    greedy = client.completions.create(**common, temperature=0.0,
                                       extra_body={"ignore_eos": True}).choices[0]
    start = next(i for i in range(3, len(greedy.text) - 2) if "\ufffd" not in greedy.text[i:i + 2])
    stop = greedy.text[start:start + 2]
    stopped = client.completions.create(**common, temperature=0.0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == greedy.text[:greedy.text.index(stop)]
    penalized = client.completions.create(**common, temperature=0.0, presence_penalty=1.5,
                                          frequency_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.3,
                                                      "min_tokens": 4, "ignore_eos": True})
    assert penalized.usage.completion_tokens == 16


def test_32_concurrent_requests_match_offline(server: Server, offline_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]

    async def run() -> list[str]:
        async with server.async_client() as client:
            results = await asyncio.gather(*[
                client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=16,
                                          temperature=0.0) for p in PROMPTS])
        return [r.choices[0].text for r in results]

    assert asyncio.run(run()) == expected


def test_async_stream_matches_non_stream(server: Server) -> None:
    async def run() -> tuple[str, str]:
        async with server.async_client() as client:
            kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                          max_tokens=10, temperature=0.0)
            full = await client.chat.completions.create(**kwargs)
            stream = await client.chat.completions.create(**kwargs, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            return full.choices[0].message.content, text

    full, streamed = asyncio.run(run())
    assert full == streamed


def test_client_disconnect_aborts_request(server: Server) -> None:
    idle_usage = server.metric("pagedllm:kv_cache_usage_perc")
    aborted_before = server.metric("pagedllm:request_success_total", 'finished_reason="abort"')
    body = {"model": MODEL_NAME, "prompt": "A long story:", "max_tokens": 1000,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(headers=server.auth, timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.metric("pagedllm:num_requests_running") == 1
            assert server.metric("pagedllm:kv_cache_usage_perc") > idle_usage
    deadline = time.monotonic() + 10
    while server.metric("pagedllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the dropped request kept running"
        time.sleep(0.05)
    assert server.metric("pagedllm:kv_cache_usage_perc") == idle_usage
    assert server.metric("pagedllm:request_success_total",
                         'finished_reason="abort"') == aborted_before + 1


def test_non_streamed_client_disconnect_aborts_request(server: Server) -> None:
    aborted_before = server.metric("pagedllm:request_success_total", 'finished_reason="abort"')
    body = {"model": MODEL_NAME, "prompt": "Another long story:", "max_tokens": 1000,
            "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.auth, timeout=0.5)
    deadline = time.monotonic() + 10
    while server.metric("pagedllm:request_success_total",
                        'finished_reason="abort"') != aborted_before + 1:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    assert server.metric("pagedllm:num_requests_running") == 0


def test_serve_parser() -> None:
    import argparse

    from pagedllm.entrypoints.openai.cli_args import add_serve_parser, run_serve

    parser = argparse.ArgumentParser(prog="pagedllm")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 8000, None, None)
    assert args.func is run_serve
    args = parser.parse_args(["serve", "--model", "m", "--port", "9", "--api-key", "k",
                              "--served-model-name", "a", "b", "--dtype", "float32",
                              "--kv-cache-memory-bytes", "1000"])
    assert (args.model, args.port, args.api_key, args.served_model_name, args.dtype,
            args.kv_cache_memory_bytes) == ("m", 9, "k", ["a", "b"], "float32", 1000)


_GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {**_GOOD, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**_GOOD, "logit_bias": {"3": 500}}, 400, "logit_bias"),
    ("/v1/completions", {**_GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**_GOOD, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**_GOOD, "top_p": 0.0}, 400, "top_p"),
    ("/v1/completions", {**_GOOD, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {**_GOOD, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {**_GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {**_GOOD, "prompt": 3.5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("/v1/completions", '{"prompt": "Hello", ', 400, None),
    ("/v1/completions", {**_GOOD, "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 2000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "robot",
                                                                 "content": "x"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
])
def test_bad_requests_get_openai_errors(server: Server, path: str, body, status: int,
                                        param: str | None) -> None:
    r = server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    ok = server.post("/v1/completions", _GOOD)  # the server keeps serving
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_body_that_is_not_utf8_is_named(server: Server) -> None:
    r = server.post("/v1/completions", b'{"prompt": "\xff\xfe"}')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == ("malformed JSON body: not UTF-8 text (invalid start "
                                            "byte at byte 12)")
    assert server.post("/v1/completions", _GOOD).status_code == 200


def test_bad_request_through_client(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", n=0)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL_NAME, logprobs=True, top_logprobs=21,
                                       messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                "content": "Hi"}])


def test_metrics_and_reset_prefix_cache(server: Server) -> None:
    before = {name: server.metric(name) for name in (
        "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total",
        "pagedllm:time_to_first_token_seconds_count", "pagedllm:e2e_request_latency_seconds_count",
        "pagedllm:inter_token_latency_seconds_count", "pagedllm:prefix_cache_queries_total",
        "pagedllm:prefix_cache_hits_total")}
    prompt = "Shared prefix for the cache " * 4
    for _ in range(2):
        r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                            "ignore_eos": True})
        assert r.status_code == 200
    usage = r.json()["usage"]
    after = {name: server.metric(name) for name in before}
    assert after["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] \
        == 2 * usage["prompt_tokens"]
    assert after["pagedllm:generation_tokens_total"] \
        - before["pagedllm:generation_tokens_total"] == 10
    assert after["pagedllm:time_to_first_token_seconds_count"] \
        - before["pagedllm:time_to_first_token_seconds_count"] == 2
    assert after["pagedllm:e2e_request_latency_seconds_count"] \
        - before["pagedllm:e2e_request_latency_seconds_count"] == 2
    assert after["pagedllm:inter_token_latency_seconds_count"] \
        - before["pagedllm:inter_token_latency_seconds_count"] == 8
    assert after["pagedllm:prefix_cache_queries_total"] > before[
        "pagedllm:prefix_cache_queries_total"]
    assert after["pagedllm:prefix_cache_hits_total"] > before["pagedllm:prefix_cache_hits_total"]
    text = httpx.get(server.url + "/metrics").text
    for name in ("pagedllm:num_requests_waiting", "pagedllm:num_preemptions_total",
                 "pagedllm:request_success_total"):
        assert name in text
    r = server.post("/reset_prefix_cache", {})
    assert r.status_code == 200 and r.json()["num_uncached_blocks"] > 0
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401
    hits = server.metric("pagedllm:prefix_cache_hits_total")
    server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert server.metric("pagedllm:prefix_cache_hits_total") == hits  # cache was emptied
    assert json.loads(server.post("/v1/completions", _GOOD).text)["usage"]["completion_tokens"] \
        == 4


def test_n_sequences_per_prompt(server: Server) -> None:
    client = server.client()
    common = dict(model=MODEL_NAME, max_tokens=8, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    single = client.completions.create(prompt="Tell me", n=3, **common)
    assert [c.index for c in single.choices] == [0, 1, 2]
    assert len({c.text for c in single.choices}) > 1  # seeds seed, seed+1, seed+2
    assert single.usage.completion_tokens == 3 * 8
    batch = client.completions.create(prompt=["Tell me", "Other"], n=3, **common)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices[:3]] == [c.text for c in single.choices]
    streamed = [""] * 3
    for chunk in client.completions.create(prompt="Tell me", n=3, stream=True, **common):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in single.choices]

    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(messages=messages, n=2, **common)
    texts = [""] * 2
    for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **common):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]


def test_logprobs(server: Server, offline_llm: LLM) -> None:
    client = server.client()
    prompt = "Logprobs please"
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                     temperature=0.0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == full.choices[0].text or "\ufffd" in full.choices[0].text
    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                          logprobs=2, ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0]
    expected = [entry[t].logprob for t, entry in zip(offline.token_ids, offline.logprobs)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()))
    assert lp.text_offset[0] == 0

    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                  temperature=0.0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**kwargs)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    streamed = [t for chunk in client.chat.completions.create(**kwargs, stream=True)
                for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == \
        [(t.token, round(t.logprob, 4)) for t in content]
    plain_kwargs = {k: v for k, v in kwargs.items() if k != "top_logprobs"}
    plain = client.chat.completions.create(**{**plain_kwargs, "logprobs": False})
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(**{**kwargs, "logprobs": False})  # as OpenAI and vLLM


def test_echo_with_prompt_logprobs(server: Server, offline_llm: LLM) -> None:
    client = server.client()
    prompt = "Echo my logprobs"
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3,
                                     temperature=0.0, logprobs=1, echo=True,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3,
                                                          logprobs=1, prompt_logprobs=1,
                                                          ignore_eos=True),
                                   use_tqdm=False)[0]
    prompt_ids = offline.prompt_token_ids
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [entry[t].logprob for t, entry in zip(prompt_ids[1:], offline.prompt_logprobs[1:])]
    assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx(expected, abs=1e-4)
    assert resp.choices[0].text.startswith(prompt)


def _assert_offsets_index_text(lp, text: str) -> None:
    assert "".join(lp.tokens) == text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_completion_logprob_strings_join_to_text(server: Server, offline_llm: LLM) -> None:
    """Issue #17: token strings in context; with echo the BOS adds "" and offsets index the text."""
    client = server.client()
    tokenizer = offline_llm.get_tokenizer()
    common = dict(model=MODEL_NAME, max_tokens=16, temperature=1.0, seed=3, logprobs=2,
                  extra_body={"ignore_eos": True})
    for prompt in ["  Leading spaces 🙂 café", " The cat sees 東京", "🚀"]:
        for echo in (False, True):
            choice = client.completions.create(prompt=prompt, echo=echo, **common).choices[0]
            _assert_offsets_index_text(choice.logprobs, choice.text)
            if echo:
                assert choice.text.startswith(prompt) and choice.logprobs.tokens[0] == ""
        ids = tokenizer(prompt).input_ids  # echo of ids: the text of all ids, "<s>" included
        choice = client.completions.create(prompt=ids, echo=True, **common).choices[0]
        assert choice.text.startswith("<s>" + prompt)
        assert choice.logprobs.tokens[0] == "<s>"
        _assert_offsets_index_text(choice.logprobs, choice.text)
        text, tokens, offsets = "", [], []
        for chunk in client.completions.create(prompt=prompt, stream=True, **common):
            for c in chunk.choices:
                text += c.text
                if c.logprobs:
                    tokens += c.logprobs.tokens
                    offsets += c.logprobs.text_offset
        assert "".join(tokens) == text
        assert [text[o:o + len(t)] for o, t in zip(offsets, tokens)] == tokens


def test_chat_logprob_bytes_of_emoji_byte_tokens(server: Server, offline_llm: LLM) -> None:
    """Issue #17: each byte token of an emoji reports its own bytes, not U+FFFD's."""
    client = server.client()
    tokenizer = offline_llm.get_tokenizer()
    emoji_ids = tokenizer("🙂", add_special_tokens=False).input_ids
    # byte-level pieces of F0 9F 99 82 (GPT-2's byte-to-character table)
    assert tokenizer.convert_ids_to_tokens(emoji_ids) == ["ðŁ", "Ļ", "Ĥ"]
    replacement = list("\ufffd".encode())
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Smile"}], max_tokens=12,
        temperature=1.0, seed=1, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True, "allowed_token_ids": emoji_ids})
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == 12
    assert all(t.bytes != replacement for t in content)
    assert "".join(t.token for t in content) == choice.message.content
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.decode("utf-8", errors="replace") == choice.message.content
    assert {bytes(t.bytes) for t in content} <= {b"\xf0\x9f", b"\x99", b"\x82"}
    assert all(top.bytes != replacement for t in content for top in t.top_logprobs)
    # Free-running text: the chosen tokens' bytes join to the text's UTF-8.
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "  Hi 🙂"}], max_tokens=24,
        temperature=1.0, seed=2, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    joined = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
    assert joined.decode("utf-8", errors="replace") == choice.message.content
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content


@pytest.fixture(scope="module")
def sentencepiece_server(tiny_checkpoints):
    args = ["--model", str(tiny_checkpoints["mistral"]), "--api-key", API_KEY,
            "--served-model-name", MODEL_NAME, "--uvicorn-log-level", "warning", *ENGINE_FLAGS]
    with running_server(args) as (proc, url):
        yield Server(proc, int(url.rsplit(":", 1)[1]))


def test_sentencepiece_logprob_strings_keep_spaces(sentencepiece_server: Server,
                                                   tiny_checkpoints) -> None:
    """Issue #17 on a byte-fallback SentencePiece tokenizer: leading spaces kept, echo joins,
    emoji byte tokens carry their own bytes."""
    client = sentencepiece_server.client()
    common = dict(model=MODEL_NAME, max_tokens=16, temperature=1.0, seed=5, logprobs=2,
                  extra_body={"ignore_eos": True})
    for prompt in ["  Leading spaces and 🙂", "The cat sees a red apple"]:
        for echo in (False, True):
            choice = client.completions.create(prompt=prompt, echo=echo, **common).choices[0]
            _assert_offsets_index_text(choice.logprobs, choice.text)
            if echo:
                assert choice.logprobs.tokens[0] == "" and choice.text.startswith(prompt)
    spaced = [t for t in choice.logprobs.tokens if t.startswith(" ")]
    assert spaced, "SentencePiece word pieces keep their leading space"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoints["mistral"])
    rocket = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "🚀".encode()]
    cat = tokenizer.convert_tokens_to_ids("▁cat")
    assert cat != tokenizer.unk_token_id
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi 🚀"}], max_tokens=24,
        temperature=1.0, seed=2, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "allowed_token_ids": rocket + [cat]})
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert {bytes(t.bytes) for t in content} <= {bytes([b]) for b in "🚀".encode()} | {b" cat"}
    assert all(t.bytes != list("\ufffd".encode()) for t in content)
    assert "".join(t.token for t in content) == choice.message.content
    joined = b"".join(bytes(t.bytes) for t in content)
    # ByteFallback turns a whole run of byte tokens into U+FFFDs when any byte of it is invalid;
    # where the text has none, the bytes join to its UTF-8.
    if "\ufffd" not in choice.message.content:
        assert joined == choice.message.content.encode()
    assert joined.replace(b"\xf0\x9f\x9a\x80", b"").count(b" cat") == \
        choice.message.content.replace("🚀", "").count(" cat")
