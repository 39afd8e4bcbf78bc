"""The tool-call formats of the common open model families (vLLM's parser names).

- `hermes` (Hermes, Qwen2.5, Qwen3, QwQ): each call is
  `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`; text before the first call is the
  message content.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): the whole output is one or more
  `{"name": "f", "parameters": {...}}` objects separated by ";", optionally after
  `<|python_tag|>`.
- `mistral` (Mistral / Mixtral instruct v0.3 and later): `[TOOL_CALLS]` followed by a JSON list
  `[{"name": "f", "arguments": {...}}, ...]`, or (tokenizer v11+) by `f[ARGS]{...}`, one
  `[TOOL_CALLS]` per call.

Formats follow the models' chat templates; the parsing code is our own.
"""

from __future__ import annotations

import random
import re
import string

from pagedllm.entrypoints.openai.tool_parsers.base import (FunctionCall, ParsedToolCalls,
                                                           ToolParser, json_list_items,
                                                           json_values)


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CLOSE = "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        start = text.find(self.markers[0])
        if start < 0:
            return ParsedToolCalls()
        result = ParsedToolCalls(section_start=start)
        pos = start
        while text.startswith(self.markers[0], pos):
            body_start = pos + len(self.markers[0])
            close = text.find(self._CLOSE, body_start)
            if close < 0 and not final:
                break
            body = text[body_start:] if close < 0 else text[body_start:close]
            call = _one_json_call(body, ("arguments",))
            if call is None:
                break
            result.calls.append(call)
            if close < 0:
                break
            pos = close + len(self._CLOSE)
            while pos < len(text) and text[pos].isspace():
                pos += 1
        return result


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        stripped = text.lstrip()
        offset = len(text) - len(stripped)
        if stripped.startswith(self.markers[0]):
            offset += len(self.markers[0])
        elif not stripped.startswith("{"):
            return ParsedToolCalls()
        result = ParsedToolCalls(section_start=0)
        for value, _ in json_values(text, offset, ";"):
            call = FunctionCall.from_json(value, ("parameters", "arguments"))
            if call is None:
                break
            result.calls.append(call)
        return result

    def holdback(self, text: str) -> int:
        # A call can only open the output: until the first visible character says otherwise,
        # hold everything back.
        stripped = text.lstrip()
        if not stripped or self.markers[0].startswith(stripped):
            return len(text)
        return 0


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    _ARGS = "[ARGS]"
    _NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)")

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        marker = self.markers[0]
        start = text.find(marker)
        if start < 0:
            return ParsedToolCalls()
        result = ParsedToolCalls(section_start=start)
        pos = start
        while text.startswith(marker, pos):
            pos += len(marker)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if text.startswith("[", pos):                  # [TOOL_CALLS][{...}, {...}]
                for value, pos in json_list_items(text, pos):
                    call = FunctionCall.from_json(value)
                    if call is None:
                        return result
                    result.calls.append(call)
                return result
            name = self._NAME.match(text, pos)             # [TOOL_CALLS]f[ARGS]{...}
            if name is None or not text.startswith(self._ARGS, name.end()):
                return result
            values = json_values(text, name.end() + len(self._ARGS), "")
            decoded = next(values, None)
            if decoded is None or not isinstance(decoded[0], dict):
                return result
            result.calls.append(FunctionCall.from_json({"name": name.group(1),
                                                        "arguments": decoded[0]}))
            pos = decoded[1]
            while pos < len(text) and text[pos].isspace():
                pos += 1
        return result

    def new_call_id(self) -> str:
        # Mistral's chat templates accept only 9 alphanumeric characters as a tool call id.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _one_json_call(body: str, arguments_keys: tuple[str, ...]) -> FunctionCall | None:
    """The call in `body` when it is exactly one JSON object (whitespace around it allowed)."""
    values = list(json_values(body, 0, ""))
    if len(values) != 1 or body[values[0][1]:].strip():
        return None
    return FunctionCall.from_json(values[0][0], arguments_keys)
