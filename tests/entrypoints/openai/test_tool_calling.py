"""Tool calling and reasoning output through a real server and the official `openai` client.

The server runs a tiny random Llama whose tokenizer has the Hermes markers and `<think>` tokens
and a chat template that renders tools, tool calls and tool results
(`tests/fixtures/tokenizers.TOOL_CHAT_TEMPLATE`), with `--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser deepseek_r1`. A random model never ends its reasoning
by itself, so requests that want an answer bias `</think>` up (`END_THINK`): the first token then
closes the reasoning, and the constraint of a tool choice starts on the next token (the grammar
masks `</think>` from there on) - which is the behaviour under test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
import transformers

from tests.entrypoints.openai.server_process import running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def end_think(tool_model: Path) -> dict[str, int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tool_model)
    return {str(tokenizer.convert_tokens_to_ids("</think>")): 100}


@pytest.fixture(scope="module")
def client(tool_model: Path):
    args = ["--model", str(tool_model), "--served-model-name", "tools",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "deepseek_r1", "--uvicorn-log-level", "warning",
            "--dtype", "float32", "--kv-cache-memory-bytes", "16000000"]
    with running_server(args) as (_, url):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _create(client: openai.OpenAI, stream: bool, **kwargs):
    """Non-streamed: the message and finish reason. Streamed: the same, joined from deltas the
    way an OpenAI client joins them (tool calls by index)."""
    body = {"model": "tools", "messages": MESSAGES, "temperature": 0, "max_tokens": 64, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        reasoning = choice.message.model_extra.get("reasoning_content")
        return reasoning, choice.message.content, calls, choice.finish_reason
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", "", ""])
            entry[0] = call.id or entry[0]
            entry[1] += call.function.name or ""
            entry[2] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return (reasoning or None, content or None, [tuple(calls[i]) for i in sorted(calls)],
            finish)


def _check_calls(calls: list[tuple[str, str, str]]) -> None:
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_")
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _same_answer(a, b) -> None:
    """Equal apart from the random call ids."""
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
    assert [c[1:] for c in a[2]] == [c[1:] for c in b[2]]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_gives_valid_calls(client, end_think, parallel: bool) -> None:
    kwargs = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel,
              "logit_bias": end_think}
    whole = _create(client, False, **kwargs)
    streamed = _create(client, True, **kwargs)
    _same_answer(whole, streamed)
    reasoning, content, calls, finish = whole
    assert reasoning is None and content is None        # an empty reasoning is null
    _check_calls(calls)
    if not parallel:
        assert len(calls) == 1
    assert finish == "tool_calls" or (parallel and finish == "length")


def test_named_function_and_round_trip(client, end_think, tool_model: Path) -> None:
    kwargs = {"tools": TOOLS, "logit_bias": end_think,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = _create(client, False, **kwargs)
    _same_answer(whole, _create(client, True, **kwargs))
    _, content, calls, finish = whole
    assert content is None and finish == "stop" and [c[1] for c in calls] == ["get_weather"]
    _check_calls(calls)

    # The call and its result go back into the conversation; the template renders both.
    call_id, name, arguments = calls[0]
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name,
                                                            "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"forecast": "sunny"}'}]
    response = client.chat.completions.create(model="tools", messages=conversation,
                                              tools=TOOLS, tool_choice="none", max_tokens=4,
                                              temperature=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tool_model)
    template_view = [*conversation[:1], {**conversation[1], "tool_calls": [
        {**conversation[1]["tool_calls"][0], "function": {"name": name,
                                                          "arguments": json.loads(arguments)}}]},
        conversation[2]]
    expected = tokenizer.apply_chat_template(template_view, tools=TOOLS, tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    assert response.usage.prompt_tokens == len(expected)
    assert '"sunny"' in tokenizer.decode(expected)


@pytest.mark.parametrize("before", ["", r"\n\n"])
def test_auto_tool_choice_reads_calls_from_text(client, end_think, before: str) -> None:
    """Whitespace before the call is no content, streamed or not (the stream once sent it)."""
    forced = before + \
        r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}</tool_call>'
    kwargs = {"tools": TOOLS, "logit_bias": end_think,
              "extra_body": {"structured_outputs": {"regex": forced}}}
    whole = _create(client, False, **kwargs)
    _same_answer(whole, _create(client, True, **kwargs))
    reasoning, content, calls, finish = whole
    assert reasoning is None and content is None and finish == "tool_calls"
    assert [(name, json.loads(args)) for _, name, args in calls] == [("get_time",
                                                                      {"zone": "CET"})]


def test_required_resolves_refs_inside_each_function(client, end_think) -> None:
    """`$ref`s of a function's parameters ("#/definitions/...", "#/properties/...", "#") point
    into that function's schema, not into the wrapper array of tool_choice "required"."""
    params = {"type": "object", "definitions": {"n": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}},
              "properties": {"a": {"$ref": "#/definitions/n"}, "b": {"$ref": "#/properties/a"},
                             "c": {"type": "boolean"}},
              "required": ["a", "b", "c"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "pick", "parameters": params}}
    _, _, calls, finish = _create(client, False, tools=[tool], tool_choice="required",
                                  parallel_tool_calls=False, logit_bias=end_think)
    assert finish == "tool_calls" and calls[0][1] == "pick"
    jsonschema.validate(json.loads(calls[0][2]), params)


def test_structured_output_starts_after_the_reasoning(client, end_think) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"model": "tools", "messages": MESSAGES, "temperature": 0, "max_tokens": 32,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema}}}
    # The reasoning ends at once: the answer is constrained JSON.
    response = client.chat.completions.create(logit_bias=end_think, **body)
    answer = response.choices[0]
    assert answer.message.model_extra["reasoning_content"] is None    # empty: null
    assert response.usage.completion_tokens_details.reasoning_tokens == 1   # just </think>
    jsonschema.validate(json.loads(answer.message.content), schema)
    # The reasoning never ends (</think> banned): the output is free reasoning, no answer.
    banned = {k: -100 for k in end_think}
    thinking = client.chat.completions.create(logit_bias=banned, **{**body, "max_tokens": 8})
    choice = thinking.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"]
    assert thinking.usage.completion_tokens_details.reasoning_tokens == 8


@pytest.mark.parametrize("kwargs,param,message", [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "repeated: \\['get_weather'\\]"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools", "invalid JSON schema"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages", "needs tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages", "arguments must be a JSON object"),
    ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs",
     "cannot be overridden"),
    ({"extra_body": {"chat_template_kwargs": {"return_tensors": "pt"}}},
     "chat_template_kwargs", "cannot be overridden"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}], "tool_choice": "required"}, "tools", "must be an object schema"),
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"chat_template_kwargs": {
        "x": json.loads("[" * 150 + "]" * 150)}}}, "chat_template_kwargs", "nested deeper"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f",
                                                     "arguments": "[" * 100000 + "]" * 100000}}]}]},
     "messages", "arguments must be a JSON object"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": NaN}'}}]}]},
     "messages", "arguments must be a JSON object"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "content is required"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages",
     "tool messages only"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools", "type"),
])
def test_bad_tool_requests_are_refused(client, kwargs, param, message) -> None:
    body = {"model": "tools", "messages": MESSAGES, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = info.value.body
    assert info.value.status_code == 400
    assert re.search(message, error["message"]), error
    if param is not None:
        assert error["param"] == param
