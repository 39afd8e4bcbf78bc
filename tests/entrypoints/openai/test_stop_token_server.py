"""The server with `--tool-call-parser llama3_json`, which turns special-token skipping off: the
EOS that ends a reply is not text, so a reply that is one tool call has no content (it was
"</s>"), streamed or not; a `stop_token_ids` hit's text follows include_stop_str_in_output.

The tiny random model is forced by a regex (structured output): once the regex is complete only
EOS may follow, so the reply is the call, then EOS.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import transformers

from tests.entrypoints.openai.server_process import running_server

CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What time is it in Berlin?"}]
FORCED_CALL = r'\{"name": "get_time", "parameters": \{"zone": "CET"\}\}'


@pytest.fixture(scope="module")
def client(tool_model: Path):
    args = ["--model", str(tool_model), "--served-model-name", "tools",
            "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
            "--uvicorn-log-level", "warning", "--dtype", "float32",
            "--kv-cache-memory-bytes", "16000000"]
    with running_server(args) as (_, url):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, stream: bool, **kwargs):
    """(content, [(name, arguments)], finish_reason, stop_reason); streamed: joined deltas."""
    body = {"model": "tools", "messages": MESSAGES, "temperature": 0, "max_tokens": 96,
            **kwargs}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        return (choice.message.content, calls, choice.finish_reason,
                choice.model_extra.get("stop_reason"))
    content, calls, finish, stop_reason = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
        stop_reason = (choice.model_extra or {}).get("stop_reason", stop_reason)
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish, stop_reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_reply_has_no_eos_content(client, stream: bool) -> None:
    content, calls, finish, _ = _chat(client, stream, tools=[CLOCK], extra_body={
        "structured_outputs": {"regex": FORCED_CALL}})
    assert content is None and finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls] == [("get_time",
                                                                   {"zone": "CET"})]


@pytest.mark.parametrize("stream", [False, True])
def test_plain_reply_has_no_eos_text(client, stream: bool) -> None:
    """No tools (skipping stays on), and skip_special_tokens=False asked for directly."""
    for extra in ({}, {"skip_special_tokens": False}):
        content, calls, finish, _ = _chat(client, stream, extra_body={
            "structured_outputs": {"regex": "Hello there"}, **extra})
        assert (content, calls, finish) == ("Hello there", [], "stop")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_follows_include_stop_str(client, tool_model: Path,
                                                  include: bool) -> None:
    """A `stop_token_ids` hit through the tool parser's path (skipping off): "!" is its own
    token and no other token holds a "!", so the forced "It is late!" ends with it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tool_model)
    [stop_id] = tokenizer("!", add_special_tokens=False).input_ids
    assert [t for t in tokenizer.get_vocab() if "!" in t] == ["!"]
    for stream in (False, True):
        content, _, finish, stop_reason = _chat(client, stream, tools=[CLOCK], extra_body={
            "structured_outputs": {"regex": "It is late!"}, "stop_token_ids": [stop_id],
            "include_stop_str_in_output": include})
        assert finish == "stop" and stop_reason == stop_id
        assert content == ("It is late!" if include else "It is late")
