"""Reasoning output: models that think inside `<think>...</think>` before they answer.

A reasoning parser (`--reasoning-parser`, vLLM's flag) does two jobs:

- on the server, it splits each output into `reasoning_content` and `content`
  (`ReasoningParser.split`, also incrementally for streams);
- in the engine, its marker token ids let structured output start only after the reasoning
  ends (`ReasoningParser.marker_token_ids`, used by the StructuredOutputManager), so a JSON
  schema constrains the answer and never the thinking.
"""

from pagedllm.reasoning.parsers import (REASONING_PARSERS, ReasoningParser, ReasoningSplit,
                                        get_reasoning_parser)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "get_reasoning_parser"]
