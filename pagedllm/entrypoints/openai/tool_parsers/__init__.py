"""Tool-call parsers (`--tool-call-parser`): find the function calls in a model's output text."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (FunctionCall, ParsedToolCalls,
                                                           ToolParser)
from pagedllm.entrypoints.openai.tool_parsers.formats import (HermesToolParser,
                                                              Llama3JsonToolParser,
                                                              MistralToolParser)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """A parser instance for `name`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{sorted(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "FunctionCall", "ParsedToolCalls", "ToolParser", "get_tool_parser"]
