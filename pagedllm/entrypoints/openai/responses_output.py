"""One answer's text -> Responses output items, and the stream events that build them.

The chat output reader (`chat_output.ChoiceOutputParser.deltas`) splits the text into reasoning,
content and tool-call deltas; `ResponseOutputBuilder` turns that sequence into output items - a
`reasoning` item, an assistant `message` with one `output_text` part, a `function_call` item per
call - opening a new item whenever the kind of delta changes, and returns the Responses stream
events of each step (`response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`, the matching `.done` events, `response.output_item.done`).
A whole answer is built by feeding its final deltas at once, so a streamed answer and a whole one
have the same items. Every event carries the stream's `sequence_number` (from 0).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_responses import (OutputFunctionCall, OutputItem,
                                                            OutputMessage, OutputReasoning,
                                                            OutputText, ReasoningText)


class ResponseOutputBuilder:
    """Builds the output items of one answer from its deltas (see the module docstring).

    Attributes:
        items: the output items so far (the open one last, its text growing).
    """

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._sequence_number = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A stream event of type `kind` with the next sequence number."""
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events for `deltas` (`ChoiceOutputParser.deltas`' format)."""
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if "reasoning_content" in delta:
                events += self._text_delta(OutputReasoning, delta["reasoning_content"])
            elif "content" in delta:
                events += self._text_delta(OutputMessage, delta["content"])
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    events += self._open_item(OutputFunctionCall(
                        id=random_id("fc"), call_id=call["id"], name=call["function"]["name"],
                        arguments="", status="in_progress"))
                events += self._arguments_delta(call["function"].get("arguments") or "")
        return events

    def finish(self, incomplete: bool = False) -> list[dict[str, Any]]:
        """Close the open item, with status "incomplete" when the output was cut
        (`max_output_tokens`), as OpenAI marks it; an answer without any item gets an empty
        message (the whole answer and the stream alike)."""
        status = "incomplete" if incomplete else "completed"
        events = self._close(status)
        if not self.items:
            events += self._text_delta(OutputMessage, "") + self._close(status)
        return events

    # ------------------------------------------------------------------ items
    def _text_delta(self, kind: type, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not isinstance(self._open, kind):
            if kind is OutputMessage:
                item, part = OutputMessage(id=random_id("msg"), status="in_progress"), \
                    OutputText(text="")
            else:
                item, part = OutputReasoning(id=random_id("rs"), status="in_progress"), \
                    ReasoningText(text="")
            events += self._open_item(item)
            events.append(self._part_event("response.content_part.added", part))
            item.content.append(part)
        if not text:
            return events
        self._open.content[0].text += text
        delta_type = ("response.output_text.delta" if kind is OutputMessage
                      else "response.reasoning_text.delta")
        extra = {"logprobs": []} if kind is OutputMessage else {}
        events.append(self.event(delta_type, item_id=self._open.id,
                                 output_index=len(self.items) - 1, content_index=0,
                                 delta=text, **extra))
        return events

    def _arguments_delta(self, arguments: str) -> list[dict[str, Any]]:
        if not arguments:
            return []
        self._open.arguments += arguments
        return [self.event("response.function_call_arguments.delta", item_id=self._open.id,
                           output_index=len(self.items) - 1, delta=arguments)]

    def _open_item(self, item: OutputItem) -> list[dict[str, Any]]:
        events = self._close()
        self.items.append(item)
        self._open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=item.model_dump()))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, events = self._open, []
        if item is None:
            return events
        index = len(self.items) - 1
        if isinstance(item, OutputFunctionCall):
            events.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                     output_index=index, name=item.name,
                                     arguments=item.arguments))
        else:
            part = item.content[0]
            if isinstance(item, OutputMessage):
                events.append(self.event("response.output_text.done", item_id=item.id,
                                         output_index=index, content_index=0, text=part.text,
                                         logprobs=[]))
            else:
                events.append(self.event("response.reasoning_text.done", item_id=item.id,
                                         output_index=index, content_index=0, text=part.text))
            events.append(self._part_event("response.content_part.done", part))
        item.status = status
        events.append(self.event("response.output_item.done", output_index=index,
                                 item=item.model_dump()))
        self._open = None
        return events

    def _part_event(self, kind: str, part: OutputText | ReasoningText) -> dict[str, Any]:
        return self.event(kind, item_id=self._open.id, output_index=len(self.items) - 1,
                          content_index=0, part=part.model_dump())
