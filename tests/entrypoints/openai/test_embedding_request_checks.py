"""Bad bodies of POST /v1/embeddings on a tiny Llama embedder (the app in process): each is a
400 naming the field, as on the completion routes, and the server goes on embedding."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.entrypoints.openai.embedding_server import build_embedding_app


@pytest.fixture(scope="module")
def http(tiny_llama):
    engine = PoolingEngine.from_engine_args(str(tiny_llama), dtype="float32", max_model_len=64)
    with TestClient(build_embedding_app(engine, ["emb"])) as client:
        yield client


def _post(http: TestClient, raw: bytes):
    return http.post("/v1/embeddings", content=raw, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("raw", "field"), [
    # A lone surrogate is valid JSON that no tokenizer takes: it reached the tokenizer and
    # came back as a 500 "internal error: TypeError".
    (b'{"input": "a \\ud800 b"}', "input"),
    (b'{"input": ["ok", "\\udfff"]}', "input"),
    # Values of the wrong JSON type were coerced: true embedded as token id 1, "5" as 5.
    (b'{"input": [true, 2]}', "input"),
    (b'{"input": "hi", "truncate_prompt_tokens": "5"}', "truncate_prompt_tokens"),
    (b'{"input": "hi", "normalize": "yes"}', "normalize"),
    # An unknown (e.g. misspelt) field was ignored: "normalise" left the vector normalised.
    (b'{"input": "hi", "normalise": false}', "normalise"),
])
def test_bad_body_is_a_400_naming_the_field(http, raw: bytes, field: str) -> None:
    r = _post(http, raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    ok = http.post("/v1/embeddings", json={"input": [[3, 4], [5]], "truncate_prompt_tokens": 5,
                                           "normalize": False, "user": "u", "model": "emb"})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 2
