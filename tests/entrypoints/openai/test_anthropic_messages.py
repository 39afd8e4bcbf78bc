"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through a real server
and the official `anthropic` client.

One server for the module: the tiny tool-calling Llama (`tool_model`: a chat template that renders
system, tools, tool calls and tool results) with `--enable-auto-tool-choice --tool-call-parser
hermes` and an API key. The oracle for what a Messages request runs is the server's own
/v1/chat/completions with the equivalent chat request (same greedy text, same prompt length) and
the tokenizer's chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest
import transformers

from tests.entrypoints.openai.server_process import running_server

API_KEY = "messages-key"
MODEL = "tools"
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Weather forecast for a city.",
           "input_schema": WEATHER_SCHEMA}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": WEATHER_SCHEMA}}
USER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
# This SDK version has no sampling arguments; the server still reads them (older clients send
# them), so they travel in `extra_body`.
GREEDY = {"model": MODEL, "extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(tool_model: Path):
    args = ["--model", str(tool_model), "--served-model-name", MODEL, "--api-key", API_KEY,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--uvicorn-log-level", "warning", "--dtype", "float32",
            "--kv-cache-memory-bytes", "16000000"]
    with running_server(args) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server: str):
    """The SDK as it comes (this version sends the key as `Authorization: Bearer`)."""
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: str):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tool_model: Path):
    return transformers.AutoTokenizer.from_pretrained(tool_model)


def _chat(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body},
                         headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_text_equals_chat_completions(client, http) -> None:
    message = client.messages.create(max_tokens=12, messages=USER, **GREEDY)
    chat = _chat(http, max_tokens=12, messages=USER)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert _text(message) == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert message.stop_reason == expected and message.stop_sequence is None


def test_system_prompt_is_rendered_first(client, http, tokenizer) -> None:
    system = "You answer in one word."
    message = client.messages.create(max_tokens=8, system=system, messages=USER, **GREEDY)
    conversation = [{"role": "system", "content": system}, *USER]
    expected = tokenizer.apply_chat_template(conversation, tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    assert message.usage.input_tokens == len(expected)
    assert _text(message) == _chat(http, max_tokens=8, messages=conversation)[
        "choices"][0]["message"]["content"]
    # System as text blocks: the same prompt.
    blocks = client.messages.create(max_tokens=8, messages=USER, **GREEDY,
                                    system=[{"type": "text", "text": system}])
    assert blocks.usage.input_tokens == len(expected) and _text(blocks) == _text(message)


def test_stop_sequences_and_max_tokens(client) -> None:
    whole = client.messages.create(max_tokens=16, messages=USER, **GREEDY)
    text = _text(whole)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 16, whole
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = client.messages.create(max_tokens=16, messages=USER, stop_sequences=["@@@", stop],
                                 **GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[:text.index(stop)]


def test_stream_equals_whole(client) -> None:
    body = {"max_tokens": 12, "messages": USER, "system": "Be brief.", **GREEDY}
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == _text(whole) and streamed_text
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The stream ran the same prompt a second time: its full blocks came from the prefix cache.
    assert final.usage.cache_read_input_tokens > 0


def test_stream_events_in_order(client) -> None:
    """Anthropic's event sequence: message_start, one text block, message_delta, message_stop."""
    with client.messages.create(max_tokens=6, messages=USER, stream=True, **GREEDY) as events:
        kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}


def _forced_call(client, stream: bool, **kwargs):
    body = {"max_tokens": 64, "messages": USER, "tools": [WEATHER], **GREEDY,
            "tool_choice": {"type": "tool", "name": "get_weather"}, **kwargs}
    if not stream:
        return client.messages.create(**body)
    with client.messages.stream(**body) as events:
        return events.get_final_message()


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_use_streamed_equals_whole(client, choice: dict) -> None:
    whole = _forced_call(client, False, tool_choice=choice)
    streamed = _forced_call(client, True, tool_choice=choice)
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use", message
        [call] = [block for block in message.content if block.type == "tool_use"]
        assert call.name == "get_weather" and call.id
        jsonschema.validate(call.input, WEATHER_SCHEMA)
    assert [(b.type, getattr(b, "input", None)) for b in whole.content] == \
        [(b.type, getattr(b, "input", None)) for b in streamed.content]


def test_tool_use_tool_result_round_trip(client, http, tokenizer) -> None:
    first = _forced_call(client, False)
    [call] = first.content
    result = '{"forecast": "sunny"}'
    conversation = [*USER, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": result},
                        {"type": "text", "text": "Thanks, and tomorrow?"}]}]
    answer = client.messages.create(max_tokens=6, messages=conversation, tools=[WEATHER],
                                    tool_choice={"type": "none"}, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(block.type == "text" for block in answer.content)
    # The answer's blocks echoed as dicts carry the SDK's extra tool_use fields (caller, ...).
    echoed = [*conversation[:1], {"role": "assistant",
                                  "content": [b.model_dump() for b in first.content]},
              conversation[2]]
    assert "caller" in echoed[1]["content"][0]
    again = client.messages.create(max_tokens=6, messages=echoed, tools=[WEATHER],
                                   tool_choice={"type": "none"}, **GREEDY)
    assert again.usage.input_tokens == answer.usage.input_tokens
    # The chat endpoint's equivalent conversation: the same prompt and the same greedy text.
    chat_conversation = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
        {"role": "user", "content": "Thanks, and tomorrow?"}]
    chat = _chat(http, max_tokens=6, messages=chat_conversation, tools=[CHAT_WEATHER],
                 tool_choice="none")
    assert answer.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert _text(answer) == chat["choices"][0]["message"]["content"]
    template_view = [*chat_conversation[:1], {**chat_conversation[1], "tool_calls": [
        {**chat_conversation[1]["tool_calls"][0], "function": {
            "name": call.name, "arguments": call.input}}]}, *chat_conversation[2:]]
    expected = tokenizer.apply_chat_template(template_view, tools=[CHAT_WEATHER], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    assert answer.usage.input_tokens == len(expected)
    assert '"sunny"' in tokenizer.decode(expected)


def test_output_config_json_schema(client) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}},
              "required": ["city"], "additionalProperties": False}
    message = client.messages.create(max_tokens=32, messages=USER, **GREEDY, output_config={
        "format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads(_text(message)), schema)


def test_count_tokens(client) -> None:
    body = {"model": MODEL, "messages": USER, "system": "Be brief."}
    counted = client.messages.count_tokens(**body).input_tokens
    assert counted == client.messages.create(max_tokens=1, **body).usage.input_tokens
    with_tools = client.messages.count_tokens(**body, tools=[WEATHER]).input_tokens
    assert with_tools > counted     # the template renders the tools
    assert with_tools == client.messages.create(
        max_tokens=1, **body, tools=[WEATHER],
        tool_choice={"type": "none"}).usage.input_tokens


_BAD = [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "messages", "'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools",
     "web_search_20250305"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking",
     "--reasoning-parser"),
    ({"thinking": {"type": "enabled"}}, "thinking", "needs budget_tokens"),
    ({"thinking": {"type": "between_tools", "budget_tokens": 8}}, "thinking", "between_tools"),
    ({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}]}, "messages",
     "prefill"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens", "context length"),
    ({"extra_body": {"temperature": -1.0}}, "temperature", "temperature"),
    ({"extra_body": {"top_k": -5}}, "top_k", "top_k"),
    ({"stop_sequences": [""]}, "stop_sequences", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice",
     "nope"),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto"}, "max_tokens": 2}, None, None),
    ({"extra_body": {"frequency_penalty": 1.0}}, "frequency_penalty", "Extra inputs"),
    ({"output_config": {"effort": "high"}}, "output_config", "effort"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking", "omitted"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 2000}}, "thinking", "budget"),
    ({"thinking": {"type": "adaptive"}, "metadata": {"user_id": "u1"}}, None, None),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "get_weather", "input": {}}]}]}, "messages",
     "assistant turns"),
]


@pytest.mark.parametrize("change, param, words", _BAD)
def test_bad_input_is_a_400_naming_the_field(client, http, change: dict, param: str | None,
                                             words: str | None) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": USER, **change}
    if param is None:       # valid (e.g. auto tool choice on a server with a parser)
        assert client.messages.create(**body).stop_reason in ("end_turn", "max_tokens",
                                                              "tool_use")
        return
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**body)
    error = caught.value.body["error"]
    assert caught.value.body["type"] == "error" and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error
    # The engine goes on.
    assert client.messages.create(max_tokens=2, messages=USER, **GREEDY).content


def test_unknown_model_is_not_found(client) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-x", max_tokens=2, messages=USER)
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_api_key_by_x_api_key_or_bearer(server: str, http) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": USER}
    by_header = anthropic.Anthropic(base_url=server, api_key=None, max_retries=0,
                                    default_headers={"x-api-key": API_KEY})
    assert by_header.messages.create(**body).content is not None
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert http.post("/v1/messages", json=body, headers=headers).status_code == 200
        assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        assert http.get("/v1/models", headers=headers).status_code == 200
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(**body)
    assert caught.value.body["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {}):
        response = http.post("/v1/messages/count_tokens", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["type"] == "error"
        chat = http.post("/v1/chat/completions", json=body, headers=headers)
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"


def test_validation_errors_have_anthropic_shape(http) -> None:
    headers = {"x-api-key": API_KEY}
    response = http.post("/v1/messages", content=b"{", headers={
        **headers, "Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = http.post("/v1/messages", json={"model": MODEL, "messages": USER},
                         headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    response = http.post("/v1/messages", content=b" " * (9 << 20), headers=headers)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    assert int(response.headers["content-length"]) == len(response.content)


@pytest.fixture(scope="module")
def reasoning_client(tool_model: Path):
    """A second server, with `--reasoning-parser deepseek_r1`: the tiny random model never closes
    its reasoning, so its whole output is thinking."""
    args = ["--model", str(tool_model), "--served-model-name", MODEL, "--reasoning-parser",
            "deepseek_r1", "--uvicorn-log-level", "warning", "--dtype", "float32",
            "--kv-cache-memory-bytes", "16000000"]
    with running_server(args) as (_, url):
        yield anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


def test_prefill_continues_the_final_assistant_turn(client, http, tokenizer) -> None:
    messages = [*USER, {"role": "assistant", "content": "The forecast says"}]
    message = client.messages.create(max_tokens=8, messages=messages, **GREEDY)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             continue_final_message=True)
    assert rendered.endswith("The forecast says")
    assert message.usage.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    chat = _chat(http, messages=messages, max_tokens=8, add_generation_prompt=False,
                 continue_final_message=True)
    assert _text(message) == chat["choices"][0]["message"]["content"]


def test_thinking_budget_ends_the_reasoning(reasoning_client, tokenizer) -> None:
    end = tokenizer.convert_tokens_to_ids("</think>")
    body = {"max_tokens": 10, "messages": USER, **GREEDY}
    free = reasoning_client.messages.create(**body)
    assert [b.type for b in free.content] == ["thinking"]     # never closes on its own
    capped = reasoning_client.messages.create(
        **body, thinking={"type": "enabled", "budget_tokens": 3})
    thinking, text = capped.content
    assert thinking.type == "thinking" and text.type == "text" and text.text
    assert free.content[0].thinking.startswith(thinking.thinking)
    assert end not in tokenizer.encode(text.text, add_special_tokens=False)


def test_reasoning_comes_back_as_thinking_blocks(reasoning_client) -> None:
    body = {"max_tokens": 10, "messages": USER, "thinking": {"type": "adaptive"}, **GREEDY}
    whole = reasoning_client.messages.create(**body)
    [block] = whole.content
    assert block.type == "thinking" and block.thinking and block.signature == ""
    assert whole.stop_reason == "max_tokens"
    with reasoning_client.messages.stream(**body) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_message()
    assert "thinking" in kinds      # the SDK's event for a thinking_delta
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", block.thinking)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        reasoning_client.messages.create(**{**body, "thinking": {"type": "disabled"}})
    assert caught.value.body["error"]["param"] == "thinking"
