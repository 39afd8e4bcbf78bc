"""The tool-call formats of the common open model families (vLLM's parser names).

- `hermes` (Hermes, Qwen2.5, Qwen3, QwQ): each call is
  `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`; text around the calls is content.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): the output is one or more
  `{"name": "f", "parameters": {...}}` objects separated by ";", optionally after
  `<|python_tag|>`.
- `mistral` (Mistral / Mixtral instruct v0.3 and later): `[TOOL_CALLS]` followed by a JSON list
  `[{"name": "f", "arguments": {...}}, ...]`, or (tokenizer v11+) by `f[ARGS]{...}`, one
  `[TOOL_CALLS]` per call.

Text that looks like a call but does not parse stays content, word for word: with `hermes` that
block, with `mistral` (as vLLM) the whole output, since its calls are one list. Formats follow the
models' chat templates; the parsing code is our own.
"""

from __future__ import annotations

import random
import re
import string

from pagedllm.entrypoints.openai.tool_parsers.base import (FunctionCall, ParsedToolCalls,
                                                           ToolParser, json_values)
from pagedllm.reasoning.parsers import partial_marker_len


class HermesToolParser(ToolParser):
    name = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        result = ParsedToolCalls()
        pos = 0
        while True:
            start = text.find(self._OPEN, pos)
            if start < 0:
                tail = text[pos:]
                tail = tail[:len(tail) - (0 if final else partial_marker_len(tail, self._OPEN))]
                result.content += self._gap(tail, result)
                return result
            result.content += self._gap(text[pos:start], result)
            body_start = start + len(self._OPEN)
            close = text.find(self._CLOSE, body_start)
            if close < 0:
                if final:           # cut off after the call: it counts if it is complete
                    call = _one_json_call(text[body_start:], ("arguments",))
                    if call is not None:
                        result.calls.append(call)
                    else:
                        result.content += text[start:]
                return result       # a stream holds an open call back until it closes
            call = _one_json_call(text[body_start:close], ("arguments",))
            if call is not None:
                result.calls.append(call)
            else:
                result.content += text[start:close + len(self._CLOSE)]
            pos = close + len(self._CLOSE)

    @staticmethod
    def _gap(text: str, result: ParsedToolCalls) -> str:
        """Text between or after calls is content unless it is only whitespace (a stream holds
        such a gap back until something else follows it)."""
        return text if not result.calls or text.strip() else ""


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        stripped = text.lstrip()
        if not final and (not stripped or self._TAG.startswith(stripped)):
            return ParsedToolCalls()            # undecided: a call can only open the output
        offset = len(text) - len(stripped)
        if stripped.startswith(self._TAG):
            offset += len(self._TAG)
        elif not stripped.startswith("{"):
            return ParsedToolCalls(content=text)
        result = ParsedToolCalls()
        end = offset
        for value, end_of_value in json_values(text, offset, ";"):
            call = FunctionCall.from_json(value, ("parameters", "arguments"))
            if call is None:
                break
            result.calls.append(call)
            end = end_of_value
        if final:
            rest = text[end:] if result.calls else text
            if rest.strip(" \n\t;"):
                result.content = rest
        return result


class MistralToolParser(ToolParser):
    name = "mistral"
    _MARKER, _ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)")
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        start = text.find(self._MARKER)
        if start < 0:
            keep = len(text) - (0 if final else partial_marker_len(text, self._MARKER))
            return ParsedToolCalls(content=text[:keep])
        if not final:
            # A later call that fails to parse turns the whole output into content, so nothing
            # after the marker is decided before the output ends.
            return ParsedToolCalls(content=text[:start])
        result = ParsedToolCalls(content=text[:start])
        while start >= 0:
            segment = self._segment_calls(text, start)
            if segment is None:
                return ParsedToolCalls(content=text)    # as vLLM: the whole output, word for word
            result.calls.extend(segment[0])
            start = text.find(self._MARKER, segment[1])
            gap = text[segment[1]:start if start >= 0 else len(text)]
            if gap.strip():                 # text between and after calls; whitespace is dropped
                result.content += gap
        return result

    def _segment_calls(self, text: str, pos: int) -> tuple[list[FunctionCall], int] | None:
        """The calls after the marker at `pos` and the index where they end, or None when they
        do not parse: a list that is not all calls or does not close, a name without `[ARGS]`
        and a complete JSON object."""
        body = pos + len(self._MARKER)
        while body < len(text) and text[body].isspace():
            body += 1
        if text.startswith("[", body):                      # [TOOL_CALLS][{...}, {...}]
            decoded = next(json_values(text, body, ""), None)
            if decoded is None:
                return None
            calls = [FunctionCall.from_json(item) for item in decoded[0]]
            if any(call is None for call in calls):
                return None
            return calls, decoded[1]
        name = self._NAME.match(text, body)                 # [TOOL_CALLS]f[ARGS]{...}
        if name is None or not text.startswith(self._ARGS, name.end()):
            return None
        decoded = next(json_values(text, name.end() + len(self._ARGS), ""), None)
        if decoded is None or not isinstance(decoded[0], dict):
            return None
        return [FunctionCall.from_json({"name": name.group(1), "arguments": decoded[0]})], \
            decoded[1]

    def new_call_id(self) -> str:
        # Mistral's chat templates accept only 9 alphanumeric characters as a tool call id.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _one_json_call(body: str, arguments_keys: tuple[str, ...]) -> FunctionCall | None:
    """The call in `body` when it is exactly one JSON object (whitespace around it allowed)."""
    values = list(json_values(body, 0, ""))
    if len(values) != 1 or body[values[0][1]:].strip():
        return None
    return FunctionCall.from_json(values[0][0], arguments_keys)
