"""Chat requests with image content parts (`image_url` with a base64 `data:` URL): rendered
with the model's processor and its images processed off the event loop, in the front end.

Remote (`http(s)://`) and local (`file:`) image URLs are refused with a 400 naming the problem:
fetching them for clients is an SSRF risk this server does not take (issue #42 lists the
allow-list design that would be needed).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError

_IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def has_image_parts(request) -> bool:
    """Whether some message of a chat request holds an image content part."""
    return any(isinstance(m.content, list) and any(
        isinstance(p, dict) and p.get("type") in _IMAGE_PART_TYPES for p in m.content)
        for m in request.messages)


def _conversation(request) -> list[dict[str, Any]]:
    """Role and content (string or parts) of each message; `image_pil` parts are an offline
    (`LLM.chat`) form and are refused here."""
    conversation = []
    for i, m in enumerate(request.messages):
        if isinstance(m.content, list):
            for part in m.content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIServingError(f"messages[{i}]: unsupported content part type "
                                             f"{kind!r}", 400, param="messages")
        conversation.append({"role": m.role, "content": m.content or ""})
    return conversation


async def render_image_chat(request, mm_processor) -> tuple[list[int], list]:
    """Token ids (image placeholders expanded) and the images' features of a chat request
    with image parts.

    Raises:
        OpenAIServingError: 400 naming messages for a text-only model, a request chat template
            or tools (not combined with images yet), a bad part, an undecodable or oversized
            image, a URL that is not a data: URL, or more images than --limit-mm-per-prompt.
    """
    if mm_processor is None:
        raise OpenAIServingError("messages: this model takes text only; image content parts "
                                 "need a vision-language model", 400, param="messages")
    if request.chat_template is not None or request.tools:
        raise OpenAIServingError("messages: image content parts cannot be combined with a "
                                 "request chat_template or tools yet", 400, param="messages")
    conversation = _conversation(request)
    try:
        text, images = mm_processor.render_chat(conversation, request.add_generation_prompt)
        # Decoding and resizing images is CPU work: off the event loop.
        return await asyncio.to_thread(mm_processor.process, text, images)
    except ValueError as e:
        raise OpenAIServingError(str(e), 400, param="messages") from None
