"""What every tool-call format shares: parsed calls, JSON scanning, and the parser interface.

A `ToolParser` reads a model's output text and finds the tool calls in it. It answers one
question, `parse(text, final)`: which calls are complete, and which text is content. The same
call serves a whole response (`final=True`: a last call may lack its closing marker, and text
that fails to parse is content) and a stream (`final=False`: only calls no continuation can
undo count, and text that may still become or undo a call is held back). A stream's reading is a
prefix of the whole one's: for any continuation, its content starts the whole output's content
(or the whole text, when that has no calls) and its calls are the first of that one's calls, so a
streamed answer is always the same as the whole one (see `chat_output.ChoiceOutputParser`).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class FunctionCall:
    """One parsed call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str

    @classmethod
    def from_json(cls, obj: Any, arguments_keys: tuple[str, ...] = ("arguments",)
                  ) -> FunctionCall | None:
        """The call in a decoded `{"name": ..., "<arguments key>": {...}}`, or None when the
        object is not a call (no string name, or arguments that are not an object)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args: Any = {}
        for key in arguments_keys:
            if key in obj:
                args = obj[key]
                break
        if isinstance(args, str):       # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return cls(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class ParsedToolCalls:
    """The result of `ToolParser.parse`.

    Attributes:
        content: the text that is not part of a call (in a stream: so far as decided).
        calls: the complete calls, in order.
    """

    content: str = ""
    calls: list[FunctionCall] = field(default_factory=list)


def json_values(text: str, pos: int, separators: str) -> Iterator[tuple[Any, int]]:
    """Decode consecutive JSON values of `text` from `pos`, skipping whitespace and any of
    `separators` between them. Yields (value, end index); stops at the first value that does
    not decode (incomplete or not JSON) or at the end of the text."""
    n = len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= n:
            return
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield value, pos


def json_list_items(text: str, pos: int) -> Iterator[tuple[Any, int]]:
    """Items of a JSON array that starts at `text[pos]` ("["), each as soon as it is complete,
    so a stream sees the array's items one by one. Stops at "]" or an incomplete item."""
    if pos >= len(text) or text[pos] != "[":
        return
    for value, end in json_values(text, pos + 1, ","):
        yield value, end
        rest = text[end:].lstrip()
        if rest.startswith("]"):
            return


def openai_call_id() -> str:
    """A fresh tool-call id in OpenAI's `call_...` shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    """A model family's tool-call format.

    Attributes:
        name: the `--tool-call-parser` value.
        needs_special_tokens: True when a marker is a special token, so outputs must be
            detokenized with `skip_special_tokens=False` for the parser to see it.
    """

    name: str = ""
    needs_special_tokens: bool = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        """The content and the complete calls of `text`.

        `final`: the text is the whole output, so a last call without its closing marker counts
        when it decodes (formats with closing markers), and what does not parse is content;
        otherwise (a stream) only calls that can no longer change count, and text that may
        still be part of a call, or turn one into content, is left out of the content."""

    def new_call_id(self) -> str:
        """A fresh id for a call this parser found."""
        return openai_call_id()
