"""Pydantic models of the OpenAI API subset we serve (field names and shapes as OpenAI's).

Requests carry vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, ...).
An unknown field is refused with a 400 naming it, as OpenAI's API does ("Unrecognized request
argument"), and so is a known field this server cannot honour (`suffix`, `best_of` other than `n`):
silently dropping a field that changes what the answer must be would return a wrong answer.
Floats must be finite (NaN and Infinity are refused). Turning a request into `SamplingParams`
lives here so completions and chat share one mapping: a sampling field the request leaves out
(None) takes the model's default (its generation config,
`generation_config.get_diff_sampling_param`), else the built-in one
(`BUILTIN_SAMPLING_DEFAULTS`), as vLLM's `to_sampling_params` does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.beam_search import check_length_penalty
from pagedllm.sampling_params import SamplingParams
from pagedllm.entrypoints.openai.tool_choice import check_tools, tool_call_schema
from pagedllm.structured_output.params import StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "pagedllm"
    root: str | None = None
    # A LoRA adapter's base model (None for the base model itself).
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Deepest nesting of JSON arrays/objects a request field may have. Real schemas and arguments
# stay far below; deeper values would exhaust the recursion of the code that walks them (schema
# compilation, chat templates).
MAX_JSON_DEPTH = 100


def _json_value_problem(value: Any) -> str | None:
    """Why a JSON-like value cannot be accepted, or None: "lone_surrogate" for a string with a
    lone UTF-16 surrogate (a valid JSON escape such as "\\ud800" that no tokenizer or UTF-8
    encoder accepts), "too_deep" for nesting beyond MAX_JSON_DEPTH. Iterative, so any depth is
    safe to check."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "lone_surrogate"
        elif isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                return "too_deep"
            children = (item if isinstance(item, list)
                        else [part for pair in item.items() for part in pair])
            stack.extend((child, depth + 1) for child in children)
    return None


class _StrictModel(BaseModel):
    """Unknown fields, values of the wrong JSON type (no coercion: "2" is not an int, false is
    not a float), non-finite floats, text that is not valid Unicode and values nested deeper
    than MAX_JSON_DEPTH are validation errors (400 naming the field)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_bad_json_values(cls, data: Any) -> Any:
        messages = {
            "lone_surrogate": "text must be valid Unicode (a lone UTF-16 surrogate such as "
                              "\\ud800 is not)",
            "too_deep": f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects"}
        for key, value in (data.items() if isinstance(data, dict) else ()):
            problem = _json_value_problem(key)
            if problem is not None:     # a name that is no field (and cannot be echoed)
                raise PydanticCustomError(problem, messages[problem])
            problem = _json_value_problem(value)
            if problem is not None:
                raise PydanticCustomError(problem, messages[problem], {"field": str(key)})
        return data


class StreamOptions(_StrictModel):
    include_usage: bool = False
    # Every chunk carries the usage so far (vLLM's extension).
    continuous_usage_stats: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens of the reasoning (`--reasoning-parser`), markers too


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class JsonSchemaFormat(_StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_StrictModel):
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Values of the sampling fields a request leaves out and the model does not set (vLLM's
# _DEFAULT_SAMPLING_PARAMS).
BUILTIN_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                             "min_p": 0.0, "repetition_penalty": 1.0}


# A request id is echoed in a response header: visible ASCII only, so it cannot inject one.
REQUEST_ID_PATTERN = r"^[!-~]+$"
MAX_REQUEST_ID_CHARS = 256
# Sampling fields beam search cannot honour (given with a non-default value: refused).
BEAM_SEARCH_UNSUPPORTED = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "stop", "stop_token_ids", "min_tokens",
                           "logit_bias", "allowed_token_ids", "bad_words",
                           "truncate_prompt_tokens", "prompt_logprobs", "echo")


class _SamplingRequest(_StrictModel):
    """Fields shared by completion and chat requests (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's prefill/decode disaggregation handshake (docs/kv_connectors.md): read by the KV
    # connector; {"do_remote_decode": true} to a prefill instance, its answer's
    # kv_transfer_params to the decode instance.
    kv_transfer_params: dict[str, Any] | None = None
    # Accepted and ignored: they do not change the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's structured output fields: {"json" | "regex" | "choice" | "grammar" | "json_object"}
    # and the older guided_* spellings.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extras (docs/openai_api.md "vLLM's request extras").
    # Echoed in the response's id ("chatcmpl-<request_id>") and its X-Request-Id header.
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_CHARS,
                                   pattern=REQUEST_ID_PATTERN)
    # Logprob tokens as "token_id:<id>" strings instead of their text.
    return_tokens_as_token_ids: bool = False
    # `n` beams (vLLM's server beam search); length_penalty as in `BeamSearchParams`.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Lower first under --scheduling-policy priority; must be 0 under fcfs (vLLM's rule).
    priority: int = 0
    # Values for custom server extensions; this server defines none, so any key is refused.
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    def check_supported(self) -> None:
        """Raises ValueError naming a field this server cannot honour (the answer would be
        wrong if it were dropped)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if self.vllm_xargs:
            raise ValueError(f"vllm_xargs: this server has no extension that reads "
                             f"{sorted(self.vllm_xargs)[0]!r} (no vllm_xargs key is known)")
        if "length_penalty" in self.model_fields_set and not self.use_beam_search:
            raise ValueError("length_penalty applies to beam search only (use_beam_search: true)")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by their summed logprobs (at `temperature`); a field that
        would change which tokens a beam may take, or what is reported per token, is refused."""
        if self.n < 1:
            raise ValueError(f"n (the beam width) must be >= 1, got {self.n}")
        check_length_penalty(self.length_penalty)
        fields = type(self).model_fields
        for name in BEAM_SEARCH_UNSUPPORTED:
            if name in fields and getattr(self, name) not in (None, fields[name].default, [],
                                                              {}):
                raise ValueError(f"{name} is not supported with use_beam_search")
        if self.structured_outputs_params() is not None:
            raise ValueError(f"{self.structured_outputs_field()} is not supported with "
                             f"use_beam_search")
        if self.num_logprobs() is not None:
            raise ValueError("logprobs is not supported with use_beam_search")

    def structured_outputs_field(self) -> str:
        """The request field that carries the output constraint (for error messages)."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "structured_outputs"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, if any (raises ValueError naming the problem)."""
        specs: list[dict[str, Any]] = []
        if self.structured_outputs is not None:
            specs.append(dict(self.structured_outputs))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                specs.append({name: value})
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append({"json_object": True})
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format: json_schema.schema is required for type "
                                 "'json_schema'")
            specs.append({"json": fmt.json_schema.schema_})
        if not specs:
            return None
        if len(specs) > 1:
            raise ValueError("structured_outputs: give one constraint (response_format, "
                             "structured_outputs or guided_*), not several")
        try:
            return StructuredOutputsParams(**specs[0])
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from e

    def requested_max_tokens(self) -> int | None:
        """The request's own output cap; None = not given."""
        raise NotImplementedError

    def builtin_max_tokens(self) -> int | None:
        """The cap of a request that gives none when the model has no default either; None =
        up to the end of the context."""
        return None

    def num_logprobs(self) -> int | None:
        """Top alternatives per token to return (0 = the chosen token only); None = no logprobs."""
        raise NotImplementedError

    def to_sampling_params(self, max_tokens: int | None,
                           default_sampling_params: dict[str, Any] | None = None
                           ) -> SamplingParams:
        """The request's SamplingParams: temperature, top_p, top_k, min_p and
        repetition_penalty left out (None) come from `default_sampling_params` (the model's),
        else `BUILTIN_SAMPLING_DEFAULTS`; `max_tokens` is already resolved by the caller.

        Raises ValueError naming the field for an out-of-range value.
        """
        defaults = {**BUILTIN_SAMPLING_DEFAULTS, **(default_sampling_params or {})}
        sampling = {name: defaults[name] if getattr(self, name) is None else getattr(self, name)
                    for name in BUILTIN_SAMPLING_DEFAULTS}
        if self.kv_transfer_params is not None and self.n != 1:
            raise ValueError("kv_transfer_params (prefill/decode disaggregation) needs n=1")
        return SamplingParams(
            extra_args=(None if self.kv_transfer_params is None
                        else {"kv_transfer_params": self.kv_transfer_params}),
            logprobs=self.num_logprobs(), logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            n=self.n, **sampling,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_outputs_params())


# Output cap of a completion request that leaves max_tokens out (OpenAI's default).
COMPLETION_MAX_TOKENS = 16


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. `prompt`: a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # Left out: the model's max_new_tokens, else COMPLETION_MAX_TOKENS (OpenAI's 16); null: up
    # to the end of the context.
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    # Known but not supported: refused unless they leave the answer unchanged.
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ValueError("suffix is not supported (insertion needs a fill-in-the-middle "
                             "model and template)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported unless equal to n ({self.n}); got "
                             f"{self.best_of}")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def builtin_max_tokens(self) -> int | None:
        return None if "max_tokens" in self.model_fields_set else COMPLETION_MAX_TOKENS

    def num_logprobs(self) -> int | None:
        return self.logprobs


class FunctionCallParam(_StrictModel):
    name: str
    arguments: str


class ToolCallParam(_StrictModel):
    """A tool call of an earlier assistant message (`arguments` is JSON text, as OpenAI sends)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(BaseModel):
    # Other keys OpenAI clients send (`refusal`, `audio`, ...) are accepted and not used.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    reasoning_content: str | None = None

    def text_content(self) -> str:
        """The content as one string (text parts joined with newlines, as vLLM does).

        Raises:
            ValueError: for a non-text content part.
        """
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages: only text content parts are supported, got "
                                 f"{part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("messages: a content part of type 'text' needs a string "
                                 "'text'")
            texts.append(part["text"])
        return "\n".join(texts)


class FunctionDefinition(_StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_StrictModel):
    name: str


class ChatCompletionNamedToolChoiceParam(_StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None \
        = None
    parallel_tool_calls: bool = True
    # Extra variables for the chat template (e.g. {"enable_thinking": false} for Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extras (docs/openai_api.md "vLLM's request extras").
    # Render the last message open-ended so the model continues it (needs
    # add_generation_prompt: false).
    continue_final_message: bool = False
    # A Jinja chat template for this request (only on a server started with
    # --trust-request-chat-template).
    chat_template: str | None = None
    # Retrieval documents for templates that render them (`documents` of apply_chat_template).
    documents: list[dict[str, str]] | None = None
    # Options of the multimodal processor; a request without images has nothing to process.
    mm_processor_kwargs: dict[str, Any] | None = None
    # Passed to the chat template as `reasoning_effort` (templates that know it use it).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Most reasoning tokens before the server's reasoning parser forces the end marker.
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # Per prompt token: its logprob and the top-k alternatives (response `prompt_logprobs`).
    prompt_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false (the "
                             "last message is continued, no new one is started)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true")
        if self.reasoning_effort is not None and "reasoning_effort" in (
                self.chat_template_kwargs or {}):
            raise ValueError("reasoning_effort: give it once, as the field or in "
                             "chat_template_kwargs, not both")
        check_tools(self)

    def template_kwargs(self) -> dict[str, Any]:
        """The arguments of `apply_chat_template` this request sets beyond the conversation
        and tools: its chat_template_kwargs, documents, reasoning_effort, continue_final_message
        and add_generation_prompt (the per-request template is the server's to allow)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return {**kwargs, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def effective_tool_choice(self) -> str:
        """"none" | "auto" | "required" | "named"."""
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def structured_outputs_field(self) -> str:
        if self.effective_tool_choice() in ("required", "named"):
            return "tools"      # the constraint is built from the tools' parameter schemas
        return super().structured_outputs_field()

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint: a required or named tool choice constrains the output to
        valid calls (see `tool_choice.py`); otherwise the request's own constraint."""
        schema = tool_call_schema(self)
        if schema is None:
            return super().structured_outputs_params()
        return StructuredOutputsParams(json=schema)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token (with echo, the
    prompt's tokens first; the very first prompt token has null logprobs)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)
    # Where the text after the last token starts (`text_offset` continues from it); not sent.
    _end_offset: int = PrivateAttr(default=0)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # A prefill instance's answer for the decode instance (docs/kv_connectors.md).
    kv_transfer_params: dict[str, Any] | None = None


class FunctionCallOutput(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOutput


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs`: {token id (a JSON key): this}."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # With the request's prompt_logprobs: per prompt token (the first one has null).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    # A prefill instance's answer for the decode instance (docs/kv_connectors.md).
    kv_transfer_params: dict[str, Any] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...}, {"reasoning_content":
    # ...} or {"tool_calls": [...]} (see chat_output.py)
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # A prefill instance's answer for the decode instance (docs/kv_connectors.md).
    kv_transfer_params: dict[str, Any] | None = None


class TokenizeRequest(_StrictModel):
    """POST /tokenize in either of vLLM's two forms: `prompt` (a text, the completion form) or
    `messages` (a conversation rendered by the chat template as /v1/chat/completions renders it;
    `add_generation_prompt`, `continue_final_message`, `tools` and `chat_template_kwargs` belong
    to this form only)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatCompletionToolsParam] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # None: vLLM's default per form, True for `prompt` and False for `messages` (the chat
    # template places the special tokens itself).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_form(self) -> TokenizeRequest:
        if self.prompt is not None and self.messages is not None:
            raise PydanticCustomError("tokenize_form", "give either prompt or messages, not both",
                                      {"field": "messages"})
        if self.prompt is None and self.messages is None:
            raise PydanticCustomError("tokenize_form", "prompt (a text) or messages (a "
                                      "conversation) is required", {"field": "prompt"})
        for name in ("add_generation_prompt", "continue_final_message", "tools",
                     "chat_template_kwargs"):
            if self.prompt is not None and name in self.model_fields_set:
                raise PydanticCustomError("tokenize_form", f"{name} needs messages, not prompt",
                                          {"field": name})
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    # With return_token_strs: the tokenizer's own string of each token (e.g. "Ġworld").
    token_strs: list[str] | None = None


class DetokenizeRequest(_StrictModel):
    """POST /detokenize: token ids -> text (special tokens kept, as vLLM decodes them)."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
