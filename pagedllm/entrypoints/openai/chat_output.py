"""One chat choice's output text -> the message: reasoning, content and tool calls.

A choice is read in one of four tool modes (vLLM's and OpenAI's `tool_choice`):

- `none`: all text is content;
- `auto`: the server's tool-call parser finds calls in the text (`tool_parsers/`); the text
  around them is content; none found -> all text is content;
- `required`: the output was constrained to a JSON array `[{"name": ..., "parameters": {...}}]`
  (see `tool_choice.required_schema`), each item a call;
- `named`: the output was constrained to the named function's parameters; the whole text is that
  call's arguments.

With a reasoning parser, the reasoning is split off first and the modes read the answer after it.
`ChoiceOutputParser.result` reads a whole output; `ChoiceOutputParser.deltas` reads the text of a
stream so far and returns OpenAI's delta objects for what is new. A stream never sends text it may
have to take back (a possible marker prefix is held), so the concatenated deltas always equal the
whole response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import FunctionCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.base import json_list_items, openai_call_id
from pagedllm.reasoning import ReasoningParser


@dataclass(frozen=True)
class ToolMode:
    """How a request's output is read for tool calls.

    Attributes:
        kind: "none" | "auto" | "required" | "named".
        parser: the tool-call parser ("auto" only).
        function: the forced function's name ("named" only).
        parallel: False keeps only the first call (`parallel_tool_calls: false`).
    """

    kind: str = "none"
    parser: ToolParser | None = None
    function: str | None = None
    parallel: bool = True


NO_TOOLS = ToolMode()


@dataclass
class ChatOutput:
    """A choice's message parts. `content` is None when the message is only tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[FunctionCall] = field(default_factory=list)


def required_calls(text: str) -> list[FunctionCall]:
    """The complete calls of a `required`-mode output (a JSON array of name/parameters)."""
    stripped = text.lstrip()
    calls = []
    for value, _ in json_list_items(stripped, 0):
        call = FunctionCall.from_json(value, ("parameters",))
        if call is None:
            break
        calls.append(call)
    return calls


class ChoiceOutputParser:
    """Reads one choice's text. Keep one per choice of a stream (it remembers what was sent).

    Args:
        mode: the request's tool mode.
        reasoning: the server's reasoning parser, or None.
    """

    def __init__(self, mode: ToolMode = NO_TOOLS, reasoning: ReasoningParser | None = None
                 ) -> None:
        self.mode = mode
        self.reasoning = reasoning
        self._sent_reasoning = 0
        self._sent_content = 0
        self._call_ids: list[str] = []
        self._sent_arguments = 0

    # ------------------------------------------------------------------ whole output
    def result(self, text: str) -> ChatOutput:
        reasoning, answer = self._split(text, final=True)
        kind = self.mode.kind
        if kind == "named":
            return ChatOutput(reasoning, None, [FunctionCall(self.mode.function, answer)])
        calls: list[FunctionCall] = []
        content: str | None = answer
        if kind == "required":
            calls = required_calls(answer)
            if calls:
                content = None
        elif kind == "auto":
            parsed = self.mode.parser.parse(answer, final=True)
            if parsed.calls:
                calls = parsed.calls
                content = parsed.content if parsed.content.strip() else None
        if not self.mode.parallel:
            calls = calls[:1]
        return ChatOutput(reasoning, content, calls)

    def finish_reason(self, output: ChatOutput, finish_reason: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" when the model stopped after calling tools in
        auto or required mode (a forced named function keeps "stop", as OpenAI's API does)."""
        if finish_reason == "stop" and output.tool_calls and self.mode.kind in ("auto",
                                                                                "required"):
            return "tool_calls"
        return finish_reason

    # ------------------------------------------------------------------ stream
    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Delta objects for what `text` (the output so far; `final`: all of it) adds to what
        earlier calls returned: `{"reasoning_content": ...}`, `{"content": ...}` and
        `{"tool_calls": [...]}` in OpenAI's stream format."""
        out: list[dict[str, Any]] = []
        reasoning, answer = self._split(text, final)
        if reasoning is not None and len(reasoning) > self._sent_reasoning:
            out.append({"reasoning_content": reasoning[self._sent_reasoning:]})
            self._sent_reasoning = len(reasoning)
        kind = self.mode.kind
        if kind == "named":
            if answer or final:
                out.extend(self._named_deltas(answer))
            return out
        calls: list[FunctionCall] = []
        content = answer
        if kind == "required":
            calls = required_calls(answer)
            content = answer if final and not calls else ""
        elif kind == "auto":
            parsed = self.mode.parser.parse(answer, final)
            calls, content = parsed.calls, parsed.content
        if not self.mode.parallel:
            calls = calls[:1]
        if len(content) > self._sent_content:
            out.append({"content": content[self._sent_content:]})
            self._sent_content = len(content)
        new_calls = calls[len(self._call_ids):]
        if new_calls:
            out.append({"tool_calls": [self._call_delta(call) for call in new_calls]})
        return out

    def call_ids(self, count: int) -> list[str]:
        """Ids for the first `count` calls, the same ones a stream sent (new ids are made for
        calls a stream has not sent)."""
        while len(self._call_ids) < count:
            self._call_ids.append(self._new_call_id())
        return self._call_ids[:count]

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        split = self.reasoning.split(text, final)
        return split.reasoning, split.content

    def _new_call_id(self) -> str:
        parser = self.mode.parser
        return parser.new_call_id() if parser is not None else openai_call_id()

    def _call_delta(self, call: FunctionCall) -> dict[str, Any]:
        index = len(self._call_ids)
        self._call_ids.append(self._new_call_id())
        return {"index": index, "id": self._call_ids[-1], "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _named_deltas(self, answer: str) -> list[dict[str, Any]]:
        deltas = []
        if not self._call_ids:
            delta = self._call_delta(FunctionCall(self.mode.function, ""))
            deltas.append({"tool_calls": [delta]})
        if len(answer) > self._sent_arguments:
            deltas.append({"tool_calls": [{"index": 0, "function": {
                "arguments": answer[self._sent_arguments:]}}]})
            self._sent_arguments = len(answer)
        return deltas
