"""The server's sampling defaults from the model's generation config, through the `openai` client.

The app runs in-process (`fastapi.testclient.TestClient`, lifespan included, handed to the
official client as its HTTP client) over a tiny Llama whose generation_config.json says top_k=1,
temperature 0.8 and max_new_tokens 7: a request that leaves the sampling fields out gets the
model's defaults (greedy here, whatever its seed; 7 tokens), fields a request sends win, and the
server logs the defaults it took at start.
"""

from __future__ import annotations

import logging
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app
from tests.fixtures.checkpoints import with_generation_config

MODEL = "tiny-llama"
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=4 << 20)
PROMPTS = ["Hello world", "The old man reads a long letter.", "12345 + 678 = ?"]
LOG_LINE = "Using default sampling params from model generation config"


@pytest.fixture(scope="module")
def checkpoint(tiny_llama: Path, tmp_path_factory) -> Path:
    return with_generation_config(tiny_llama, tmp_path_factory.mktemp("top_k1_server"),
                                  top_k=1, temperature=0.8, max_new_tokens=7)


def _client(checkpoint: Path, **engine_args):
    """(openai client, TestClient) over an app on `checkpoint`; close the TestClient."""
    async_llm = AsyncLLM.from_engine_args(str(checkpoint), **ENGINE_ARGS, **engine_args)
    test_client = TestClient(build_app(async_llm, [MODEL]))
    test_client.__enter__()
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                           http_client=test_client, max_retries=0)
    return client, test_client


@pytest.fixture(scope="module")
def client(checkpoint: Path):
    client, test_client = _client(checkpoint)
    yield client
    test_client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def greedy(checkpoint: Path):
    """prompt, max_tokens -> the greedy completion text (ignore_eos), offline."""
    llm = LLM(str(checkpoint), **ENGINE_ARGS)

    def run(prompt: str, max_tokens: int) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    return run


def test_request_without_sampling_fields_takes_the_model_defaults(client, greedy) -> None:
    for seed in range(3):
        for prompt in PROMPTS:
            out = client.completions.create(model=MODEL, prompt=prompt, seed=seed,
                                            extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 7          # max_new_tokens, not 16
            assert out.choices[0].text == greedy(prompt, 7)  # top_k=1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 7


def test_request_fields_override_the_model_defaults(client, greedy) -> None:
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, seed=seed,
                                       temperature=1.0, extra_body={"top_k": -1,
                                                                    "ignore_eos": True}
                                       ).choices[0].text
             for seed in range(4) for prompt in PROMPTS]
    assert texts != [greedy(prompt, 7) for _ in range(4) for prompt in PROMPTS]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=MODEL, max_completion_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 2


def test_defaults_logged_at_start_and_generation_config_vllm(checkpoint: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedllm.entrypoints.openai.serving_engine"):
        _, test_client = _client(checkpoint)
        test_client.__exit__(None, None, None)
    assert any(LOG_LINE in r.message and "'top_k': 1" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm.entrypoints.openai.serving_engine"):
        client, test_client = _client(checkpoint, generation_config="vllm")
    try:
        assert not any(LOG_LINE in r.message for r in caplog.records)
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0],
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 16  # OpenAI's completions default
    finally:
        test_client.__exit__(None, None, None)


def test_model_max_tokens_is_cut_to_the_context(checkpoint: Path) -> None:
    """A default the client did not ask for never makes a request too long: it is cut to what
    the context leaves (an explicit max_tokens that does not fit is still a 400)."""
    client, test_client = _client(checkpoint, max_model_len=32,
                                  override_generation_config={"max_new_tokens": 1000})
    try:
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0],
                                        extra_body={"ignore_eos": True})
        assert out.usage.prompt_tokens + out.usage.completion_tokens == 32
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1000)
    finally:
        test_client.__exit__(None, None, None)
