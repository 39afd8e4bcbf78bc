"""Pydantic models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Field names and shapes are Anthropic's (https://docs.anthropic.com/en/api/messages). Requests are
strict like protocol.py's: an unknown field, a value of the wrong JSON type, a non-finite float or
an unsupported content block or tool type is a 400 naming the field. Accepted and ignored, because
they do not change the answer: `metadata`, `service_tier`, `speed`, `inference_geo`,
`cache_control` (prefix caching is automatic here), `citations` on text blocks. What cannot be
honoured is refused rather than dropped: image/document blocks, server tools (web search, code
execution...), `output_config.effort`, and `thinking` other than "adaptive" or "disabled" (no
reasoning budget is enforced; serving_messages.py checks it against the server's reasoning parser).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from pagedllm.entrypoints.openai.protocol import _StrictModel

# Content block types of Anthropic's API that this server reads; any other is refused by name.
SUPPORTED_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _check_block_types(value: Any) -> Any:
    """Refuse content blocks of a known but unsupported type (image, document, ...) with a
    message naming the type, instead of pydantic's generic union error."""
    if isinstance(value, list):
        for block in value:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in SUPPORTED_BLOCK_TYPES:
                raise PydanticCustomError(
                    "unsupported_block", "content blocks of type '{kind}' are not supported by "
                    "this server (supported: {supported})",
                    {"kind": kind, "supported": ", ".join(SUPPORTED_BLOCK_TYPES)})
    return value


class TextBlockParam(_StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlockParam(_StrictModel):
    """A tool call of an earlier assistant turn. `caller` (who made the call, for programmatic
    tool calling) and `toolset_name` are fields of the SDK's own block type, sent back when a
    client echoes an answer's content: accepted and not shown to the model."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlockParam(_StrictModel):
    """A tool's answer, in a user turn. `is_error` is accepted and not shown to the model (the
    chat template has no place for it; the content should say what failed)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_block_types(cls, value: Any) -> Any:
        return _check_block_types(value)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(block.text for block in self.content)


class ThinkingBlockParam(_StrictModel):
    """An earlier turn's reasoning: accepted and left out of the prompt (as Anthropic's API
    drops earlier turns' thinking from the context)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_StrictModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam
                              | ThinkingBlockParam | RedactedThinkingBlockParam,
                              Field(discriminator="type")]


class MessageParam(_StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]

    @field_validator("content", mode="before")
    @classmethod
    def _known_block_types(cls, value: Any) -> Any:
        return _check_block_types(value)


class ToolParam(_StrictModel):
    """A custom (client) tool; `input_schema` is the JSON schema of its input object."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


def _check_tool_types(value: Any) -> Any:
    """Refuse Anthropic's server tools (`web_search_20250305`, `bash_20250124`, ...) by name:
    they run on Anthropic's side and cannot be honoured here."""
    for tool in value if isinstance(value, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise PydanticCustomError(
                "unsupported_tool", "server tools such as '{kind}' are not supported by this "
                "server; give custom tools (name, description, input_schema)", {"kind": kind})
    return value


class ToolChoiceAuto(_StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_StrictModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_StrictModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class Metadata(_StrictModel):
    user_id: str | None = None


class ThinkingConfig(_StrictModel):
    """`{"type": "adaptive" | "disabled" | "enabled" | "between_tools", ...}`; "adaptive" (the
    model decides, as a reasoning model served with --reasoning-parser does), "enabled" with
    `budget_tokens` (the most reasoning tokens, on such a server) and "disabled" can be
    honoured (see `ServingMessages`)."""

    type: Literal["adaptive", "disabled", "enabled", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: Literal["summarized", "omitted"] | None = None


class JSONOutputFormat(_StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_StrictModel):
    """`format`: the output follows this JSON schema (structured output). `effort` cannot be
    honoured and is refused."""

    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesInput(_StrictModel):
    """The fields that make the prompt (shared by /v1/messages and its count_tokens)."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools_only(cls, value: Any) -> Any:
        return _check_tool_types(value)

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


class MessagesRequest(MessagesInput):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None


class CountTokensRequest(MessagesInput):
    """POST /v1/messages/count_tokens: the prompt fields of a Messages request."""


class CountTokensResponse(BaseModel):
    input_tokens: int


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    """The reasoning split off by the server's `--reasoning-parser` (no signature: ""). """

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    # Prompt tokens served from the prefix cache (automatic; nothing is ever "created").
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class AnthropicMessage(BaseModel):
    """The answer of POST /v1/messages (and, with empty content, the `message_start` event's).

    `stop_reason`: "end_turn" | "max_tokens" | "stop_sequence" (then `stop_sequence` is the
    matched string) | "tool_use"; None only in `message_start`."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage
