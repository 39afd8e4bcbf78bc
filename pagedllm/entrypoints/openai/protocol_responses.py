"""Pydantic models of the OpenAI Responses API subset we serve (`POST /v1/responses`).

Requests are strict like protocol.py's: an unknown field or a value of the wrong JSON type is a
400 naming the field, and so is a known value this server cannot honour (built-in tools,
`background`, image/file/audio input parts, reasoning effort or summaries, `truncation: "auto"`,
`include`). Input items are told apart by `type`; a message may leave it out (OpenAI's "easy"
input message). Answers follow the `openai` SDK's `openai.types.responses` shapes (Response,
its output items and usage) so the SDK parses them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from pagedllm.entrypoints.openai.protocol import _StrictModel

_TEXT_PARTS = ("input_text", "output_text")


class InputTextPart(_StrictModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_StrictModel):
    """An `output_text` part of an assistant message sent back (annotations and logprobs of an
    earlier answer are accepted and not used)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


def _refuse_non_text_parts(content: Any) -> Any:
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in _TEXT_PARTS:
            raise PydanticCustomError(
                "unsupported_part", "content parts of type {kind} are not supported (text "
                "only: input_text, output_text; /v1/responses takes no images, files or audio: "
                "send images to a vision model through /v1/chat/completions)", {"kind": repr(kind)})
    return content


class MessageItem(_StrictModel):
    """A message input item; `content` is text or a list of text parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputTextPart | OutputTextPart, Field(discriminator="type")]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_parts(cls, content: Any) -> Any:
        return _refuse_non_text_parts(content)

    def text(self) -> str:
        """The content as one string (parts joined with newlines, as chat messages are)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(_StrictModel):
    """A function call of an earlier answer (`arguments`: JSON text)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_StrictModel):
    """The caller's result of function call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _check_parts(cls, output: Any) -> Any:
        return _refuse_non_text_parts(output)

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


class SummaryTextPart(_StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(_StrictModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_StrictModel):
    """A reasoning item of an earlier answer, sent back with it. Accepted so that
    `input=previous.output + [...]` works; the prompt leaves it out, as chat templates leave
    out the reasoning of earlier turns."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")],
          Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")],
          Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_type, custom_error_type="unsupported_item",
                  custom_error_message="input items must be of type message, function_call, "
                                       "function_call_output or reasoning (item references and "
                                       "built-in tool calls are not supported)")]


class FunctionTool(_StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(_StrictModel):
    """`{"type": "function", "name": ...}`: the output is that function's call."""

    type: Literal["function"]
    name: str


class TextFormatText(_StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(_StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(_StrictModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_StrictModel):
    """`text`: the output's format (plain text, any JSON object, or JSON of a schema)."""

    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None


class ReasoningConfig(_StrictModel):
    """`reasoning`: accepted when empty; effort and summaries cannot be honoured (refused)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_StrictModel):
    """POST /v1/responses (OpenAI's field names; `top_k`, `min_p`, `repetition_penalty` are
    vLLM's extras). See docs/openai_api.md for what each field maps to."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    tools: list[FunctionTool] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    # False by default (stateless): a response is kept for `previous_response_id` and GET only
    # when asked (OpenAI and vLLM default to true; see docs/openai_api.md).
    store: bool = False
    previous_response_id: str | None = None
    background: bool = False
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    # Accepted and echoed or ignored: they do not change the answer.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _refuse_builtin_tools(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise PydanticCustomError(
                    "unsupported_tool", "built-in tool {kind} is not supported: this server "
                    "runs function tools only (type 'function')", {"kind": repr(kind)})
        return tools

    def check_supported(self) -> None:
        """Raises ValueError, starting with the field's name, for a value this server cannot
        honour."""
        if self.background:
            raise ValueError("background: background responses are not supported (send "
                             "background: false and stream: true to read the answer as it "
                             "comes)")
        if self.truncation == "auto":
            raise ValueError("truncation: 'auto' (dropping input items to fit the context) is "
                             "not supported; a request that does not fit gets a 400")
        if self.include:
            raise ValueError(f"include: {self.include} cannot be added to the answer (no "
                             "extra output data is supported)")
        if self.reasoning is not None and (self.reasoning.effort is not None
                                           or self.reasoning.summary is not None):
            raise ValueError("reasoning: effort and summary are not supported (the reasoning "
                             "parser reports the model's reasoning as it is)")

    def effective_tool_choice(self) -> str:
        """"none" | "auto" | "required" | "named"."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice


# ------------------------------------------------------------------------------------ answers

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The reasoning the server's reasoning parser split off, as `content` (the summary stays
    empty: no summaries are written)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: str = "completed"


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = Union[OutputMessage, OutputReasoning, OutputFunctionCall]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponsesResponse(BaseModel):
    """A Response object: the request's settings echoed, the output items and the usage.
    `status`: "in_progress" (stream start), "completed", or "incomplete" (cut by
    `max_output_tokens` or the context)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem] = Field(default_factory=list)
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    store: bool = False
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
