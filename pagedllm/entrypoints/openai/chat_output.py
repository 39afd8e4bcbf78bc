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
One reading, `ChoiceOutputParser._read(text, final)`, decides every part: `result` is the reading
of a whole output; `deltas` sends what the reading of a stream's text so far adds to what was sent.
A stream's reading holds back what the rest of the output may still change (a possible marker
prefix, whitespace-only content, an unfinished call), so each of its parts is a prefix of the whole
output's part and the concatenated deltas equal the whole response.
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
    """A choice's message parts. `reasoning` is None when there is none (no reasoning parser, or
    an empty reasoning); `content` is None when the message has tool calls and no text but
    whitespace."""

    reasoning: str | None
    content: str | None
    tool_calls: list[FunctionCall] = field(default_factory=list)


@dataclass
class _Reading:
    """`ChoiceOutputParser._read`'s answer: the reasoning ("" if none), the answer text after
    it, and the content and calls read from the answer (named mode reads only `answer`)."""

    reasoning: str
    answer: str
    content: str
    calls: list[FunctionCall]


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
        """The message of a whole output `text`: `_read(text, final=True)`, with an empty
        reasoning as None and, beside tool calls, an empty content as None."""
        read = self._read(text, final=True)
        reasoning = read.reasoning or None
        if self.mode.kind == "named":
            return ChatOutput(reasoning, None, [FunctionCall(self.mode.function, read.answer)])
        content = (read.content or None) if read.calls else read.content
        return ChatOutput(reasoning, content, read.calls)

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
        `{"tool_calls": [...]}` in OpenAI's stream format. Each part is the growth of
        `_read(text, final)`'s, so with `final` the deltas join to `result(text)`."""
        out: list[dict[str, Any]] = []
        read = self._read(text, final)
        if len(read.reasoning) > self._sent_reasoning:
            out.append({"reasoning_content": read.reasoning[self._sent_reasoning:]})
            self._sent_reasoning = len(read.reasoning)
        if self.mode.kind == "named":
            if read.answer or final:
                out.extend(self._named_deltas(read.answer))
            return out
        if len(read.content) > self._sent_content:
            out.append({"content": read.content[self._sent_content:]})
            self._sent_content = len(read.content)
        new_calls = read.calls[len(self._call_ids):]
        if new_calls:
            out.append({"tool_calls": [self._call_delta(call) for call in new_calls]})
        return out

    # ------------------------------------------------------------------ both
    def _read(self, text: str, final: bool) -> _Reading:
        """What `text` decides: the whole output's parts (`final`), or (a stream's text so far)
        the parts that no continuation can change, each a prefix of the whole output's part.

        Content beside tool calls that is only whitespace is dropped (`result` gives None); a
        stream holds whitespace-only content back until the output shows which it is."""
        reasoning, answer = self._split(text, final)
        kind = self.mode.kind
        calls: list[FunctionCall] = []
        content = answer
        if kind == "required":
            calls = required_calls(answer)
            content = answer if final and not calls else ""
        elif kind == "auto":
            parsed = self.mode.parser.parse(answer, final)
            calls = parsed.calls
            if calls or not final:
                content = parsed.content if parsed.content.strip() else ""
        if not self.mode.parallel:
            calls = calls[:1]
        return _Reading(reasoning or "", answer, content, calls)

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
