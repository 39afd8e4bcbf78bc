"""POST /v1/responses through a real server and the official `openai` client.

The server runs the tiny random Llama with the tool-calling chat template
(`tests/fixtures/tokenizers.TOOL_CHAT_TEMPLATE`) and `--enable-auto-tool-choice --tool-call-parser
hermes`. The oracle is the server's own /v1/chat/completions: a Responses request is the chat
request its fields map to, so greedy answers must be equal (text, instructions, tool round trip,
previous_response_id). Reasoning items and the store's caps are tested without a server at the
end (a random model never closes its reasoning by itself).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pagedllm.entrypoints.openai.chat_output import NO_TOOLS, ChoiceOutputParser
from pagedllm.entrypoints.openai.responses_output import ResponseOutputBuilder
from pagedllm.entrypoints.openai.responses_store import ResponseStore
from pagedllm.reasoning import get_reasoning_parser
from tests.entrypoints.openai.server_process import running_server

MODEL = "tools"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
GREEDY = {"model": MODEL, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tool_model: Path):
    args = ["--model", str(tool_model), "--served-model-name", MODEL,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--uvicorn-log-level", "warning", "--dtype", "float32",
            "--kv-cache-memory-bytes", "16000000"]
    with running_server(args) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens,
                                          **GREEDY).choices[0].message.content


def test_text_equals_chat_and_reports_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(input="Hello there", max_output_tokens=8, **GREEDY)
    assert response.object == "response" and response.model == MODEL
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == _chat_text(
        client, [{"role": "user", "content": "Hello there"}], 8)
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # max_output_tokens caps the output; hitting it makes the response incomplete.
    # The message item cut by it is "incomplete" too (OpenAI's item status).
    if usage.output_tokens == 8:
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"
    else:
        assert response.status == "completed" and response.output[0].status == "completed"


def test_instructions_are_a_system_message(client: openai.OpenAI) -> None:
    response = client.responses.create(
        instructions="Answer in French.", max_output_tokens=6, **GREEDY,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert response.instructions == "Answer in French."
    assert response.output_text == _chat_text(
        client, [{"role": "system", "content": "Answer in French."},
                 {"role": "user", "content": "Hi"}], 6)


def test_stream_equals_whole(client: openai.OpenAI) -> None:
    body = {"input": "Tell me a story", "max_output_tokens": 12, **GREEDY}
    whole = client.responses.create(**body)
    with client.responses.stream(**body, store=True) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert client.responses.retrieve(final.id).output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):
        assert kinds.count(kind) == 1, kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status


def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(input=question, tools=[WEATHER], max_output_tokens=48,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    **GREEDY)
    [call] = _calls(first)
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    # The call's result goes back: the answer equals the chat request with the same turns.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = client.responses.create(input=question + [o.model_dump(exclude_none=True)
                                                       for o in first.output] + [result],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=8,
                                     **GREEDY)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                  if k != "type"}}
    expected = client.chat.completions.create(
        messages=question + [
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                                  "function": {"name": call.name,
                                                               "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        tools=[chat_tool], tool_choice="none", max_tokens=8, **GREEDY).choices[0].message.content
    assert second.output_text == expected


def test_required_tool_choice_streams_the_arguments(client: openai.OpenAI) -> None:
    body = {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 64, **GREEDY}
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = _calls(whole)
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments == _calls(final)[0].arguments
    assert [e.arguments for e in events
            if e.type == "response.function_call_arguments.done"] == [call.arguments]


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string",
                                                        "enum": ["Paris", "Lima"]},
                                               "ok": {"type": "boolean"}},
              "required": ["city", "ok"], "additionalProperties": False}
    response = client.responses.create(
        input="Give me JSON", max_output_tokens=64, **GREEDY,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                         "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Lima"]
    days: Literal[1, 2, 3]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """The SDK's `responses.parse(text_format=...)` sends a strict json_schema and parses."""
    response = client.responses.parse(input="Weather as JSON", text_format=Weather,
                                      max_output_tokens=64, **GREEDY)
    assert isinstance(response.output_parsed, Weather)


def test_previous_response_id_continues_a_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(input="Hi", store=True, max_output_tokens=5, **GREEDY)
    second = client.responses.create(input="And then?", previous_response_id=first.id,
                                     store=True, max_output_tokens=5, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.output_text == _chat_text(client, [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}], 5)
    third = client.responses.create(input="More", previous_response_id=second.id,
                                    max_output_tokens=5, **GREEDY)
    assert third.output_text == _chat_text(client, [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "More"}], 5)
    assert client.responses.retrieve(first.id).output_text == first.output_text

    # Not stored (store defaults to false): neither continued nor retrieved.
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(input="x", previous_response_id=third.id, max_output_tokens=2)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)


_BAD = [
    pytest.param({"tools": [{"type": "web_search"}]}, "tools", id="builtin-tool"),
    pytest.param({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
                 "tools", id="code-interpreter"),
    pytest.param({"background": True}, "background", id="background"),
    pytest.param({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, "input",
        id="input-image"),
    pytest.param({"input": [{"type": "function_call_output", "call_id": "call_x",
                             "output": "1"}]}, "input", id="output-without-call"),
    pytest.param({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input",
                 id="item-reference"),
    pytest.param({"input": []}, "input", id="empty-input"),
    pytest.param({"max_output_tokens": 10**6}, "max_output_tokens", id="too-many-tokens"),
    pytest.param({"max_output_tokens": 0}, "max_output_tokens", id="zero-tokens"),
    pytest.param({"temperature": -1.0}, "temperature", id="temperature"),
    pytest.param({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
                 id="schema-missing"),
    pytest.param({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
                 "tool_choice", id="unknown-function"),
    pytest.param({"tool_choice": {"type": "web_search_preview"}}, "tool_choice",
                 id="builtin-tool-choice"),
    pytest.param({"reasoning": {"effort": "high"}}, "reasoning", id="reasoning-effort"),
    pytest.param({"include": ["reasoning.encrypted_content"]}, "include", id="include"),
    pytest.param({"truncation": "auto"}, "truncation", id="truncation-auto"),
    pytest.param({"model": "gpt-5"}, "model", id="unknown-model"),
    pytest.param({"frobnicate": 1}, "frobnicate", id="unknown-field"),
    pytest.param({"stream": True, "temperature": "hot"}, "temperature", id="stream-bad-type"),
    pytest.param({"stream": True, "max_output_tokens": 10**6}, "max_output_tokens",
                 id="stream-too-many-tokens"),
    pytest.param({"stream": True, "previous_response_id": "resp-unknown"},
                 "previous_response_id", id="stream-unknown-previous"),
    pytest.param({"stream": True, "text": {"format": {"type": "json_schema", "name": "x",
                                                      "schema": {"type": 3}}}}, "text",
                 id="stream-bad-schema"),
    pytest.param({"input": "All the world's a stage. " * 3000}, "input", id="input-too-long"),
    pytest.param({"instructions": "All the world's a stage. " * 3000}, "input",
                 id="instructions-too-long"),
]


@pytest.mark.parametrize("change, param", _BAD)
def test_bad_input_names_the_field(server: str, change: dict, param: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **change}
    response = httpx.post(f"{server}/v1/responses", json=body, timeout=60)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if change.get("input") and "input_image" in str(change["input"]):
        assert "/v1/chat/completions" in error["message"], error   # where images go
    # The server goes on.
    assert httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "hi",
                                                      "max_output_tokens": 2},
                      timeout=60).status_code == 200


@pytest.fixture(scope="module")
def reasoning_client(tool_model: Path):
    args = ["--model", str(tool_model), "--served-model-name", MODEL,
            "--reasoning-parser", "deepseek_r1", "--uvicorn-log-level", "warning",
            "--dtype", "float32", "--kv-cache-memory-bytes", "16000000"]
    with running_server(args) as (_, url):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_reasoning_item_streamed_equals_whole(reasoning_client: openai.OpenAI) -> None:
    """A random model never writes `</think>`: its whole output is the reasoning item."""
    body = {"input": "Think first", "max_output_tokens": 10, **GREEDY}
    whole = reasoning_client.responses.create(**body)
    with reasoning_client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in whole.output] == ["reasoning"]
    [reasoning] = whole.output[0].content
    assert reasoning.text and whole.output_text == ""
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == reasoning.text
    assert [i.model_dump(exclude={"id"}) for i in final.output] == \
        [i.model_dump(exclude={"id"}) for i in whole.output]

    # Sent back, the reasoning item is accepted and left out of the prompt (as chat does).
    follow = reasoning_client.responses.create(
        input=[{"role": "user", "content": "Think first"}]
        + [item.model_dump(exclude_none=True) for item in whole.output]
        + [{"role": "user", "content": "Go on"}], max_output_tokens=6, **GREEDY)
    chat = reasoning_client.chat.completions.create(
        messages=[{"role": "user", "content": "Think first"},
                  {"role": "user", "content": "Go on"}], max_tokens=6, **GREEDY)
    assert follow.output[0].content[0].text == \
        chat.choices[0].message.model_extra["reasoning_content"]


# ---------------------------------------------------------------------------- without a server

def _build(parser: ChoiceOutputParser, texts: list[str]) -> tuple[list, list]:
    builder = ResponseOutputBuilder()
    events = []
    for i, text in enumerate(texts):
        events += builder.feed(parser.deltas(text, final=i == len(texts) - 1))
    events += builder.finish()
    return [item.model_dump(exclude={"id"}) for item in builder.items], events


def test_reasoning_becomes_a_reasoning_item_streamed_or_whole() -> None:
    text = "<think>cold out</think>Wear a coat."
    reasoning = get_reasoning_parser("deepseek_r1")
    whole, _ = _build(ChoiceOutputParser(NO_TOOLS, reasoning), [text])
    streamed, events = _build(ChoiceOutputParser(NO_TOOLS, reasoning),
                              [text[:n] for n in range(1, len(text) + 1)])
    assert whole == streamed
    assert [item["type"] for item in whole] == ["reasoning", "message"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "cold out"}]
    assert whole[1]["content"][0]["text"] == "Wear a coat."
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.reasoning_text.delta") == "cold out"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_empty_answer_is_an_empty_message() -> None:
    items, events = _build(ChoiceOutputParser(NO_TOOLS), [""])
    assert items == [{"type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": "", "annotations": []}]}]
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_store_caps_count_age_and_bytes() -> None:
    store = ResponseStore(max_entries=2, max_age_s=60, max_bytes=10_000)
    for i in range(3):
        assert store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and len(store) == 2
    store.get("r1")                               # now the most recently used
    store.put({"id": "r3"}, [])
    assert store.get("r2") is None and store.get("r1") is not None
    assert not store.put({"id": "big"}, [{"text": "x" * 20_000}])
    store.put({"id": "half"}, [{"text": "x" * 6_000}])
    store.put({"id": "other"}, [{"text": "x" * 6_000}])
    assert store.get("half") is None and store.get("other") is not None
    short = ResponseStore(max_age_s=0.05)
    short.put({"id": "a"}, [])
    time.sleep(0.1)
    assert short.get("a") is None
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)
