"""The streaming fast path (SSEChunkFrame + text_choice_json / chat_choice_json) writes exactly
the event that the pydantic chunk model would (`sse_event(CompletionChunk(...))`, and the same
for chat chunks)."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.protocol import (ChatCompletionChunk, ChatStreamChoice,
                                                  CompletionChoice, CompletionChunk)
from pagedllm.entrypoints.openai.serving_engine import (SSEChunkFrame, chat_choice_json,
                                                        sse_event, text_choice_json)

TEXTS = ["", " hello", 'quote " and \\ backslash', "new\nline\ttab\r\x00\x01\x1f\x7f",
         "café 日本語 🙂 \u2028\u2029 \ufffd", "</script>&<>'"]


def _random_text(rng: random.Random) -> str:
    return "".join(chr(rng.choice([rng.randrange(0, 128), rng.randrange(128, 0x2FFF),
                                   rng.randrange(0x1F300, 0x1F6FF)]))
                   for _ in range(rng.randint(0, 12)))


def test_frame_event_equals_pydantic_chunk():
    rng = random.Random(3)
    texts = TEXTS + [_random_text(rng) for _ in range(300)]
    for i, text in enumerate(texts):
        finish, stop = [(None, None), ("stop", None), ("stop", "\n\n"), ("stop", 2),
                        ("length", None), ("abort", None)][i % 6]
        ident, model = f'cmpl-{i}"x', ["shakespeare-10m", 'm"o\\d', "模型"][i % 3]
        frame = SSEChunkFrame(CompletionChunk(id=ident, created=1700000000 + i, model=model,
                                              choices=[]))
        expected = sse_event(CompletionChunk(
            id=ident, created=1700000000 + i, model=model,
            choices=[CompletionChoice(index=i % 5, text=text, finish_reason=finish,
                                      stop_reason=stop)]))
        got = frame.event(text_choice_json(i % 5, text, finish, stop))
        assert got == expected
        assert json.loads(got[len("data: "):])["choices"][0]["text"] == text


def test_frame_needs_an_empty_choices_list():
    with pytest.raises(ValueError, match="empty choices"):
        SSEChunkFrame(CompletionChunk(id="x", created=1, model="m",
                                      choices=[CompletionChoice(index=0, text="")]))
    # Another chunk type works the same way.
    frame = SSEChunkFrame(ChatCompletionChunk(id="c", created=1, model="m", choices=[]))
    assert frame.event("").startswith('data: {"id":"c"')


def test_chat_frame_event_equals_pydantic_chunk():
    rng = random.Random(5)
    tool_call = {"index": 0, "id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Par'}}
    deltas = ([{"role": "assistant", "content": ""}, {"reasoning_content": "hmm \"so\"\n"},
               {"tool_calls": [tool_call]}, {"content": ""}]
              + [{"content": _random_text(rng)} for _ in range(200)] + [{"content": t} for t in TEXTS])
    for i, delta in enumerate(deltas):
        finish, stop = [(None, None), ("stop", None), ("tool_calls", None), ("stop", 7),
                        ("length", None)][i % 5]
        frame = SSEChunkFrame(ChatCompletionChunk(id=f"chatcmpl-{i}", created=1700000000,
                                                  model="shakespeare-10m", choices=[]))
        expected = sse_event(ChatCompletionChunk(
            id=f"chatcmpl-{i}", created=1700000000, model="shakespeare-10m",
            choices=[ChatStreamChoice(index=i % 3, delta=delta, finish_reason=finish,
                                      stop_reason=stop)]))
        assert frame.event(chat_choice_json(i % 3, delta, finish, stop)) == expected
