"""Tool calling on the request side: checks, the output constraint, and the template inputs.

`tool_choice` (OpenAI's; default "auto" when `tools` are given, else "none"):

- "none": the model sees the tools (in the chat template) but its text is not read for calls;
- "auto": the server's `--tool-call-parser` reads calls from free text (needs
  `--enable-auto-tool-choice`, as vLLM does);
- "required": the output is constrained to a JSON array of calls,
  `[{"name": <one of the tools>, "parameters": <that tool's parameters>}, ...]` (at least one; at
  most one with `parallel_tool_calls: false`) - vLLM's scheme - so the calls always parse and
  their arguments validate against the schemas;
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained
  to that function's parameters, and is its arguments.

The functions here take the request duck-typed (a `ChatCompletionRequest`), so protocol.py can
use them without an import cycle. They raise ValueError, which the server turns into a 400.
"""

from __future__ import annotations

import json
from typing import Any

# `apply_chat_template`'s own arguments: the server sets them, or they change what it returns.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def check_tools(request) -> None:
    """Raises ValueError naming the problem with the request's tools, tool_choice or
    chat_template_kwargs."""
    names = [tool.function.name for tool in request.tools or ()]
    for tool in request.tools or ():
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ValueError(f"tools: the parameters of {tool.function.name!r} must be an object "
                             f"schema (type 'object'), got type {params.get('type')!r}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tools: function names must be unique; repeated: {duplicates}")
    if request.tool_choice not in (None, "none") and not names:
        raise ValueError("tool_choice needs tools: give the functions the model may call")
    mode = request.effective_tool_choice()
    if mode == "named" and request.tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: function {request.tool_choice.function.name!r} is not "
                         f"among the tools ({names})")
    if mode in ("required", "named"):
        given = [f for f in _CONSTRAINT_FIELDS if getattr(request, f) is not None]
        fmt = request.response_format
        if fmt is not None and fmt.type != "text":
            given.append("response_format")
        if given:
            raise ValueError(f"tool_choice {mode!r} constrains the output to tool calls; it "
                             f"cannot be combined with {', '.join(given)}")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(request.chat_template_kwargs or ()))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {reserved} are set by the server and cannot be "
                         "overridden")


def parameters_schema(function) -> dict[str, Any]:
    """A function's parameters schema (an empty object schema when it has none)."""
    return function.parameters if function.parameters is not None else _EMPTY_PARAMETERS


def tool_call_schema(request) -> dict[str, Any] | None:
    """The JSON schema the output must follow for a required or named tool choice; None for
    "none" and "auto".

    In required mode each tool's parameters schema moves whole under the root's `$defs` (as
    `tool_<i>`) and its local `$ref`s ("#", "#/$defs/x", "#/properties/a", ...) are rewritten to
    point inside it, so they resolve against the function's schema, not the wrapper array.
    """
    mode = request.effective_tool_choice()
    if mode == "named":
        wanted = request.tool_choice.function.name
        [function] = [t.function for t in request.tools if t.function.name == wanted]
        return parameters_schema(function)
    if mode != "required":
        return None
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(request.tools):
        key = f"tool_{i}"
        defs[key] = _rebase_refs(parameters_schema(tool.function), f"#/$defs/{key}")
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string",
                                                 "enum": [tool.function.name]},
                                        "parameters": {"$ref": f"#/$defs/{key}"}},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches},
                              "$defs": defs}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _rebase_refs(schema: Any, root: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#...") point below `root` instead of "#"."""
    if isinstance(schema, list):
        return [_rebase_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebase_refs(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def template_tools(request) -> list[dict[str, Any]] | None:
    """The tools as the chat template receives them (OpenAI's shape, unset keys dropped)."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def template_messages(request) -> list[dict[str, Any]]:
    """The conversation as chat templates read it: role and text content, plus `tool_calls`
    (with `arguments` decoded to an object, as HF templates expect), `tool_call_id` and `name`.

    Raises:
        ValueError: a non-text content part, a tool message without `tool_call_id`, or tool-call
            arguments that are not a JSON object.
    """
    conversation = []
    for i, message in enumerate(request.messages):
        if message.content is None and message.role != "assistant":
            raise ValueError(f"messages[{i}]: content is required for role {message.role!r}")
        if message.tool_call_id is not None and message.role != "tool":
            raise ValueError(f"messages[{i}]: tool_call_id belongs on tool messages only")
        entry: dict[str, Any] = {"role": message.role, "content": message.text_content()}
        if message.name is not None:
            entry["name"] = message.name
        if message.role == "tool":
            if message.tool_call_id is None:
                raise ValueError(f"messages[{i}]: a tool message needs tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            if message.role != "assistant":
                raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")
            entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name,
                "arguments": _arguments_object(call.function.arguments, i)}}
                for call in message.tool_calls]
        conversation.append(entry)
    return conversation


def _arguments_object(arguments: str, index: int) -> dict[str, Any]:
    problem = f"messages[{index}]: tool_calls arguments must be a JSON object"
    try:
        value = json.loads(arguments, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{problem}: {e.msg}") from e
    except (ValueError, RecursionError):    # NaN/Infinity, integers too long, deep nesting
        raise ValueError(f"{problem} of finite numbers, nested at most a few hundred "
                         "levels") from None
    if not isinstance(value, dict):
        raise ValueError(problem)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
