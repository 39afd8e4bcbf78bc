"""POST /tokenize, POST /detokenize and GET /v1/models on both servers (issue #17).

The apps run in-process (`fastapi.testclient.TestClient`, lifespan included) over the tiny Llama
checkpoint: the generation app over an `AsyncLLM`, the embedding app over a `PoolingEngine` using
the same checkpoint as an embedder. Ids are checked against the checkpoint's own tokenizer and, for
the chat form, against the prompt /v1/chat/completions actually ran (its usage).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from fastapi.testclient import TestClient

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.embedding_server import build_embedding_app

NAMES = ["tiny-llama", "tiny-alias"]
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello, how are you?"}]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="module")
def generate_client(tiny_llama: Path):
    async_llm = AsyncLLM.from_engine_args(str(tiny_llama), dtype="float32",
                                          kv_cache_memory_bytes=4_000_000,
                                          max_model_len=MAX_MODEL_LEN)
    with TestClient(build_app(async_llm, NAMES, model_root=str(tiny_llama))) as client:
        yield client


@pytest.fixture(scope="module")
def embed_client(tiny_llama: Path):
    engine = PoolingEngine.from_engine_args(str(tiny_llama), dtype="float32",
                                            max_model_len=MAX_MODEL_LEN)
    with TestClient(build_embedding_app(engine, NAMES, model_root=str(tiny_llama))) as client:
        yield client


@pytest.fixture(params=["generate", "embed"])
def any_client(request: pytest.FixtureRequest) -> TestClient:
    return request.getfixturevalue(f"{request.param}_client")


def _ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_text_equals_tokenizer(any_client: TestClient, tokenizer) -> None:
    text = "Once upon a time, naïve café 🙂 <s> end"
    out = _ok(any_client.post("/tokenize", json={"model": NAMES[1], "prompt": text}))
    assert out == {"count": len(tokenizer(text).input_ids), "max_model_len": MAX_MODEL_LEN,
                   "tokens": tokenizer(text).input_ids, "token_strs": None}
    plain = _ok(any_client.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                   "return_token_strs": True}))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert plain["tokens"] == ids and plain["count"] == len(ids) < out["count"]
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    empty = _ok(any_client.post("/tokenize", json={"prompt": "", "add_special_tokens": False}))
    assert (empty["count"], empty["tokens"]) == (0, [])


def test_detokenize_round_trips(any_client: TestClient, tokenizer) -> None:
    text = "To be, or not to be: 🙂 that is the question."
    ids = _ok(any_client.post("/tokenize", json={"prompt": text}))["tokens"]
    assert ids[0] == tokenizer.bos_token_id
    assert _ok(any_client.post("/detokenize", json={"tokens": ids})) == {
        "prompt": tokenizer.decode(ids)}
    assert _ok(any_client.post("/detokenize", json={"tokens": ids[1:]}))["prompt"] == text
    assert _ok(any_client.post("/detokenize", json={"tokens": []}))["prompt"] == ""


def test_tokenize_chat_equals_the_chat_prompt(generate_client: TestClient, tokenizer) -> None:
    out = _ok(generate_client.post("/tokenize", json={"messages": MESSAGES,
                                                      "return_token_strs": True}))
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=False,
                                             add_generation_prompt=True)
    assert out["tokens"] == list(expected) and out["count"] == len(expected)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    chat = _ok(generate_client.post("/v1/chat/completions", json={
        "model": NAMES[0], "messages": MESSAGES, "max_tokens": 1}))
    assert chat["usage"]["prompt_tokens"] == out["count"]
    with_tools = _ok(generate_client.post("/tokenize", json={
        "messages": MESSAGES, "tools": [TOOL], "chat_template_kwargs": {"enable_thinking": False}}))
    assert with_tools["tokens"] == list(tokenizer.apply_chat_template(
        MESSAGES, tools=[TOOL], tokenize=True, return_dict=False, add_generation_prompt=True,
        enable_thinking=False))
    no_prompt = _ok(generate_client.post("/tokenize", json={"messages": MESSAGES,
                                                            "add_generation_prompt": False}))
    assert no_prompt["tokens"] == list(tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=False, add_generation_prompt=False))
    assert no_prompt["count"] < out["count"]


def test_tokenize_reports_texts_longer_than_the_context(generate_client: TestClient) -> None:
    text = "word " * 400  # more tokens than max_model_len, fewer characters than the gate's bound
    out = _ok(generate_client.post("/tokenize", json={"prompt": text}))
    assert out["count"] > MAX_MODEL_LEN and out["max_model_len"] == MAX_MODEL_LEN


TOO_LONG_TEXT = "a" * 1_000_000  # beyond max_prompt_chars(256) for the tiny tokenizer


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "hi", "temperature": 0}, 400, "temperature"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ["hi"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"model": NAMES[0]}, 400, "prompt"),
    ("/tokenize", ["hi"], 400, None),
    ("/tokenize", '{"prompt": "hi", ', 400, None),
    ("/tokenize", {"prompt": TOO_LONG_TEXT}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {**CHAT, "prompt": "hi"}, 400, "messages"),
    ("/tokenize", {"prompt": None}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "hi", "tools": []}, 400, "tools"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": TOO_LONG_TEXT}]}, 400, "messages"),
    ("/tokenize", {**CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {**CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {**CHAT, "tools": [TOOL, TOOL]}, 400, "tools"),
    ("/tokenize", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/tokenize", {**CHAT, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 512]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, 400, "tokens"),
    ("/detokenize", {"tokens": 1}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(generate_client: TestClient, path: str, body,
                                        status: int, param: str | None) -> None:
    if isinstance(body, str):
        r = generate_client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = generate_client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param, error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["code"] == ("model_not_found" if status == 404 else None)
    assert _ok(generate_client.post("/tokenize", json={"prompt": "hi"}))["count"] > 0


def test_embedding_server_refuses_the_chat_form(embed_client: TestClient) -> None:
    r = embed_client.post("/tokenize", json=CHAT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = embed_client.post("/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_models_list_names_and_max_model_len(any_client: TestClient, tiny_llama: Path) -> None:
    models = _ok(any_client.get("/v1/models"))
    assert [card["id"] for card in models["data"]] == NAMES
    for card in models["data"]:
        assert (card["object"], card["root"], card["max_model_len"]) == (
            "model", str(tiny_llama), MAX_MODEL_LEN)


@pytest.mark.parametrize("server", ["generate", "embed"])
def test_every_served_name_is_accepted_and_others_are_404(request: pytest.FixtureRequest,
                                                          server: str) -> None:
    client = request.getfixturevalue(f"{server}_client")
    path, body = (("/v1/completions", {"prompt": "hi", "max_tokens": 1}) if server == "generate"
                  else ("/v1/embeddings", {"input": "hi"}))
    for name in [*NAMES, None]:
        answer = _ok(client.post(path, json={**body, "model": name}))
        assert answer["model"] == NAMES[0]  # the first name is the one reported back
    for name in ("gpt-4", "tiny", "TINY-LLAMA"):
        r = client.post(path, json={**body, "model": name})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
