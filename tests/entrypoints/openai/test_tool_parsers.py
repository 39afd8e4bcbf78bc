"""Tool-call parsers, reasoning splits and the chat output reader, without a model.

Every format is read whole and as a stream fed in pieces of every size: the stream's deltas must
join to exactly the whole reading (content, reasoning and calls), and must never send text that
later turns out to be a marker.
"""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.chat_output import ChoiceOutputParser, ToolMode
from pagedllm.entrypoints.openai.tool_parsers import FunctionCall, get_tool_parser
from pagedllm.reasoning import get_reasoning_parser

WEATHER = FunctionCall("get_weather", json.dumps({"city": "Paris", "days": 3}))
TIME = FunctionCall("get_time", json.dumps({"zone": "UTC"}))

# (parser, text, expected content, expected calls)
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>{"name": "get_time", '
               '"arguments": {"zone": "UTC"}}</tool_call>', "Let me check.\n", [WEATHER, TIME]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [TIME]),
    ("hermes", "No tools needed: 2 < 3 and <tool> is not a marker.",
     "No tools needed: 2 < 3 and <tool> is not a marker.", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [WEATHER, TIME]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}',
     None, [TIME]),
    ("llama3_json", "The weather is {usually} fine.", "The weather is {usually} fine.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
                ', {"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [WEATHER, TIME]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
                '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', "Sure.", [WEATHER, TIME]),
    ("mistral", "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
]


def _stream(parser: ChoiceOutputParser, text: str, step: int) -> dict:
    """Feed `text` in pieces of `step` characters; join the deltas like an OpenAI client."""
    joined: dict = {"reasoning_content": "", "content": "", "tool_calls": {}}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for i, cut in enumerate(cuts):
        for delta in parser.deltas(text[:cut], final=i == len(cuts) - 1):
            for key in ("reasoning_content", "content"):
                joined[key] += delta.get(key, "")
            for call in delta.get("tool_calls", []):
                entry = joined["tool_calls"].setdefault(call["index"], {"name": "",
                                                                        "arguments": ""})
                if "id" in call:
                    entry["id"] = call["id"]
                entry["name"] += call.get("function", {}).get("name", "")
                entry["arguments"] += call.get("function", {}).get("arguments", "")
    return joined


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_formats_whole_and_streamed(name: str, text: str, content: str | None,
                                    calls: list[FunctionCall]) -> None:
    mode = ToolMode("auto", parser=get_tool_parser(name))
    out = ChoiceOutputParser(mode).result(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == \
        [(c.name, json.loads(c.arguments)) for c in calls]
    for step in (1, 2, 3, 7, len(text)):
        joined = _stream(ChoiceOutputParser(mode), text, step)
        assert joined["content"] == (content or "") if calls else joined["content"] == text
        streamed = [joined["tool_calls"][i] for i in sorted(joined["tool_calls"])]
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == \
            [(c.name, json.loads(c.arguments)) for c in calls]
        assert all(c["id"] for c in streamed)


def test_content_before_a_marker_is_held_back() -> None:
    parser = ChoiceOutputParser(ToolMode("auto", parser=get_tool_parser("hermes")))
    assert parser.deltas("Checking <tool_", final=False) == [{"content": "Checking "}]
    assert parser.deltas("Checking <tool_c", final=False) == []
    assert parser.deltas("Checking <toolbox", final=True) == [{"content": "<toolbox"}]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", ' \
           '"arguments": {}}</tool_call>'
    mode = ToolMode("auto", parser=get_tool_parser("hermes"), parallel=False)
    assert [c.name for c in ChoiceOutputParser(mode).result(text).tool_calls] == ["a"]
    assert list(_stream(ChoiceOutputParser(mode), text, 5)["tool_calls"]) == [0]


def test_required_and_named_modes() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, ' \
           '{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    parser = ChoiceOutputParser(ToolMode("required"))
    out = parser.result(text)
    assert out.content is None and [c.name for c in out.tool_calls] == ["get_weather",
                                                                          "get_time"]
    assert parser.finish_reason(out, "stop") == "tool_calls"
    assert parser.finish_reason(out, "length") == "length"
    joined = _stream(ChoiceOutputParser(ToolMode("required")), text, 4)
    assert [joined["tool_calls"][i]["name"] for i in (0, 1)] == ["get_weather", "get_time"]

    args = '{"city": "Paris", "days": 3}'
    named = ChoiceOutputParser(ToolMode("named", function="get_weather"))
    out = named.result(args)
    assert out.tool_calls == [FunctionCall("get_weather", args)] and out.content is None
    assert named.finish_reason(out, "stop") == "stop"       # OpenAI: a forced call stops
    joined = _stream(ChoiceOutputParser(ToolMode("named", function="get_weather")), args, 3)
    assert joined["tool_calls"][0]["name"] == "get_weather"
    assert joined["tool_calls"][0]["arguments"] == args


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("deepseek_r1", "<think>a < b</think>\n\nAnswer", "a < b", "\n\nAnswer"),
    ("deepseek_r1", "thinking without the opening tag</think>Yes", "thinking without the "
                                                                   "opening tag", "Yes"),
    ("deepseek_r1", "still thinking when cut off </thi", "still thinking when cut off </thi",
     ""),
    ("qwen3", "<think>plan</think>Done", "plan", "Done"),
    ("qwen3", "No thinking here </think> at all", None, "No thinking here </think> at all"),
    ("qwen3", "<thinker", None, "<thinker"),
])
def test_reasoning_split_whole_and_streamed(name: str, text: str, reasoning: str | None,
                                            content: str) -> None:
    parser = get_reasoning_parser(name)
    split = parser.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for step in (1, 2, 5):
        joined = _stream(ChoiceOutputParser(reasoning=parser), text, step)
        assert joined["reasoning_content"] == (reasoning or "")
        assert joined["content"] == content


def test_reasoning_then_tool_call() -> None:
    text = '<think>I should call it.</think><tool_call>{"name": "get_time", "arguments": ' \
           '{"zone": "UTC"}}</tool_call>'
    mode = ToolMode("auto", parser=get_tool_parser("hermes"))
    out = ChoiceOutputParser(mode, get_reasoning_parser("deepseek_r1")).result(text)
    assert out.reasoning == "I should call it." and out.content is None
    assert out.tool_calls == [TIME.__class__("get_time", json.dumps({"zone": "UTC"}))]


def test_unknown_parser_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*hermes"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'.*deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("text,content,names", [
    # Text between and after calls is content; a malformed block stays content word for word.
    ('A <tool_call>{"name": "g", "arguments": {}}</tool_call> mid <tool_call>{"name": "h", '
     '"arguments": {}}</tool_call> end', "A  mid  end", ["g", "h"]),
    ('<tool_call>{"name": "g", "arguments": {}}</tool_call><tool_call>{"name": "g", '
     '"arguments": {}</tool_call>', '<tool_call>{"name": "g", "arguments": {}</tool_call>',
     ["g"]),
    ('<tool_call>{"name": "g", "arguments": {}}</tool_call>\n\n', None, ["g"]),
])
def test_hermes_keeps_every_piece_of_text(text: str, content: str | None,
                                          names: list[str]) -> None:
    mode = ToolMode("auto", parser=get_tool_parser("hermes"))
    out = ChoiceOutputParser(mode).result(text)
    assert (out.content, [c.name for c in out.tool_calls]) == (content, names)
    for step in (1, 4, 9):
        joined = _stream(ChoiceOutputParser(mode), text, step)
        assert joined["content"] == (content or "")
        assert [joined["tool_calls"][i]["name"] for i in sorted(joined["tool_calls"])] == names


def test_llama3_and_mistral_keep_unparsed_text() -> None:
    for name, text, content in [
            ("llama3_json", '{"name": "g", "parameters": {}}; and then some words',
             "; and then some words"),
            ("mistral", '[TOOL_CALLS][{"name": "g", "arguments": {}}] trailing', " trailing")]:
        out = ChoiceOutputParser(ToolMode("auto", parser=get_tool_parser(name))).result(text)
        assert ([c.name for c in out.tool_calls], out.content) == (["g"], content)


def test_reasoning_tokens_are_counted_by_the_split_rule() -> None:
    start, end = 7, 8
    r1, qwen3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
    assert r1.num_reasoning_tokens([1, 2, end, 3], (start, end)) == 3
    assert r1.num_reasoning_tokens([1, 2, 3], (start, end)) == 3        # never closed
    assert qwen3.num_reasoning_tokens([start, 1, end, 3], (start, end)) == 3
    assert qwen3.num_reasoning_tokens([1, end, 3], (start, end)) == 0   # thinking off
    assert r1.num_reasoning_tokens([], (start, end)) == 0


def _streamed_message(mode: ToolMode, reasoning: str | None, text: str, cuts: list[int]
                      ) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """A stream of `text` cut at `cuts` (the last cut: the whole text, `final`), joined the way
    an OpenAI client joins deltas, as `_whole_message` gives it (a stream cannot tell an empty
    content from none: both are None here)."""
    parser = ChoiceOutputParser(mode, get_reasoning_parser(reasoning) if reasoning else None)
    parts = {"reasoning_content": "", "content": ""}
    calls: dict[int, list[str]] = {}
    for i, cut in enumerate(cuts):
        for delta in parser.deltas(text[:cut], final=i == len(cuts) - 1):
            for key in parts:
                parts[key] += delta.get(key, "")
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call.get("function", {}).get("name", "")
                entry[1] += call.get("function", {}).get("arguments", "")
    return (parts["reasoning_content"] or None, parts["content"] or None,
            [tuple(calls[i]) for i in sorted(calls)])


def _whole_message(mode: ToolMode, reasoning: str | None, text: str
                   ) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """The non-streamed (reasoning, content, [(name, arguments)]) of `text`."""
    out = ChoiceOutputParser(mode, get_reasoning_parser(reasoning) if reasoning else None
                             ).result(text)
    return out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls]


@pytest.mark.parametrize("reasoning,prefix", [(None, ""), ("deepseek_r1", "</think>"),
                                              ("deepseek_r1", "<think></think>")])
def test_hermes_whitespace_before_a_call_is_no_content_in_both_paths(
        reasoning: str | None, prefix: str) -> None:
    """Issue: `"\\n\\n<tool_call>...</tool_call>"` gave content null whole but "\\n\\n" streamed,
    and an empty reasoning "" whole but none streamed. Both are now absent in both paths."""
    mode = ToolMode("auto", parser=get_tool_parser("hermes"))
    text = prefix + '\n\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}' \
                    '</tool_call>'
    expected = (None, None, [("get_time", '{"zone": "UTC"}')])
    assert _whole_message(mode, reasoning, text) == expected
    for step in (1, 2, 3, len(text)):
        cuts = list(range(step, len(text), step)) + [len(text)]
        assert _streamed_message(mode, reasoning, text, cuts) == expected
    # Whitespace that no call follows is the whole answer, in both paths.
    assert _whole_message(mode, reasoning, prefix + "\n\n") == (None, "\n\n", [])
    assert _streamed_message(mode, reasoning, prefix + "\n\n",
                             list(range(1, len(prefix) + 3))) == (None, "\n\n", [])


@pytest.mark.parametrize("text", [
    # A bad element after a good one (the example: it gave the first call).
    '[TOOL_CALLS][{"name":"get_time","arguments":{"tz":"UTC"}}, {"name": 5}]',
    # A second call cut by max_tokens (it gave the first call and content "}").
    '[TOOL_CALLS][{"name":"get_time","arguments":{"tz":"UTC"}}, {"name":"get_time","argu',
    '[TOOL_CALLS][{"name":"get_time","arguments":{"tz":"UTC"}}',          # the list never closes
    'Sure. [TOOL_CALLS][{"name":"get_time","arguments":{"tz":"UTC"}}, 7] and more',
    '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_time[ARGS]{"tz": ',
    '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_time{"tz": "UTC"}',
    '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"} [TOOL_CALLS][{"name": "x", "arguments": []}]',
    '[TOOL_CALLS][{"name": "get_time", "arguments": {}}] then [TOOL_CALLS]get_time[ARGS]{',
])
def test_mistral_calls_that_do_not_all_parse_are_the_whole_output_as_content(text: str) -> None:
    mode = ToolMode("auto", parser=get_tool_parser("mistral"))
    assert _whole_message(mode, None, text) == (None, text, [])
    for step in (1, 5, len(text)):
        cuts = list(range(step, len(text), step)) + [len(text)]
        assert _streamed_message(mode, None, text, cuts) == (None, text, [])


def test_mistral_complete_calls_and_the_text_around_them() -> None:
    mode = ToolMode("auto", parser=get_tool_parser("mistral"))
    call = ("get_time", '{"tz": "UTC"}')
    for text, content, calls in [
            ('Sure.\n[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}]\n',
             "Sure.\n", [call]),
            ('[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}] after', " after",
             [call]),
            ('[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}\n[TOOL_CALLS]get_time[ARGS] {"tz": "UTC"}',
             None, [call, call]),
            ('[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"} and [TOOL_CALLS]get_time[ARGS]{"tz": '
             '"UTC"} end', " and  end", [call, call]),
            ("[TOOL_CALLS][]", "[TOOL_CALLS][]", [])]:
        assert _whole_message(mode, None, text) == (None, content, calls)
        for step in (1, 4, len(text)):
            cuts = list(range(step, len(text), step)) + [len(text)]
            assert _streamed_message(mode, None, text, cuts) == (None, content, calls)
    # Text before the marker streams at once; what follows waits for the end of the output.
    parser = ChoiceOutputParser(mode)
    assert parser.deltas('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
                         final=False) == [{"content": "Sure."}]


# Outputs for the property test: a reasoning part, then text and calls (valid ones, broken ones,
# and pieces of markers) in random order.
_CALLS = {
    "hermes": ['<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
               '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
               '<tool_call>{"name": "f", "arguments": {"a": 1}}'],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}}', '<|python_tag|>{"name": "g", '
                    '"arguments": "{}"}', ";"],
    "mistral": ['[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
                '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
                '[TOOL_CALLS]g[ARGS]{"b": 2}', "[TOOL_CALLS][]"],
}
_BROKEN = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", '{"name": 5}',
               '<tool_call>{"name": "g", "arguments": {"b": [1, ', "<tool>",
               '<tool_call>{"name": "g", "arguments": [1]}</tool_call>'],
    "llama3_json": ["<|python_tag|>", "{", '{"name": 5}', "<|python", '{"name": "f", "param'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", '[TOOL_CALLS][{"name": "f", "arguments": {}}, '
                '{"name": 5}]', "[TOOL_CALLS]g[ARGS]", '[TOOL_CALLS][{"name": "g", "arguments": '
                '{"c": ', "[TOOL_CALLS]g{}", "]"],
}
_REASONING = ["", "", "<think>plan</think>", "</think>", "why</think>\n", "<think></think>",
              "<think>", "cut off </thi", "<thi"]
_SPACE = ["", "", " ", "\n", "\n\n"]
_TEXT = _SPACE * 3 + ["Hi", "x < y", "}", "<", "[", "</think>", "<think>"]


def _random_output(rng: random.Random, name: str) -> str:
    parts = [rng.choice(_REASONING)]
    for _ in range(rng.randint(0, 4)):
        parts.append(rng.choice(_TEXT))
        parts.append(rng.choice(_CALLS[name] * 3 + _BROKEN[name]))
    parts.append(rng.choice(_TEXT))
    return "".join(parts)


@pytest.mark.parametrize("name", sorted(_CALLS))
@pytest.mark.parametrize("reasoning", [None, "deepseek_r1", "qwen3"])
def test_streams_join_to_the_whole_answer_for_any_output(name: str,
                                                         reasoning: str | None) -> None:
    """A property over random outputs made of markers, calls, broken calls and text, each
    streamed cut at random places and one character at a time: the joined deltas are exactly the
    whole answer (reasoning, content and calls), an empty reasoning is None and whitespace beside
    calls is no content."""
    rng = random.Random(f"{name}-{reasoning}")
    mode = ToolMode("auto", parser=get_tool_parser(name))
    for _ in range(200):
        text = _random_output(rng, name)
        whole = _whole_message(mode, reasoning, text)
        assert whole[0] != ""
        assert whole[1] is None or not whole[2] or whole[1].strip()
        cuts = sorted(set(rng.sample(range(1, len(text) + 1), min(len(text), 6)))) + [len(text)]
        for stream_cuts in (cuts, list(range(1, len(text) + 1)) or [0]):
            assert _streamed_message(mode, reasoning, text, stream_cuts) == \
                (whole[0], whole[1] or None, whole[2]), text
