"""Chat requests with image content parts (`image_url` with a base64 `data:` URL, or an
`http(s)://` / `file:` URL the server's `MediaFetcher` may fetch: multimodal/fetch.py): images
fetched asynchronously, the conversation rendered with the model's processor and the images
processed off the event loop, in the front end.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError
from pagedllm.multimodal.fetch import MediaFetcher

_IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def has_image_parts(request) -> bool:
    """Whether some message of a chat request holds an image content part."""
    return any(isinstance(m.content, list) and any(
        isinstance(p, dict) and p.get("type") in _IMAGE_PART_TYPES for p in m.content)
        for m in request.messages)


async def _conversation(request, fetcher: MediaFetcher) -> list[dict[str, Any]]:
    """Role and content (string or parts) of each message, remote and local image URLs
    fetched (to bytes); `image_pil` parts are an offline (`LLM.chat`) form and are refused."""
    conversation = []
    for i, m in enumerate(request.messages):
        content = m.content or ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIServingError(f"messages[{i}]: unsupported content part type "
                                             f"{kind!r}", 400, param="messages")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if part["type"] == "image_url" and isinstance(url, str) \
                        and fetcher.is_fetchable(url):
                    part = {"type": "image", "image": await fetcher.fetch(url)}
                parts.append(part)
            content = parts
        conversation.append({"role": m.role, "content": content})
    return conversation


async def render_image_chat(request, mm_processor, fetcher: MediaFetcher | None = None
                            ) -> tuple[list[int], list]:
    """Token ids (image placeholders expanded) and the images' features of a chat request
    with image parts.

    Raises:
        OpenAIServingError: 400 naming messages for a text-only model, a request chat template
            or tools (not combined with images yet), a bad part, an undecodable or oversized
            image, a URL the fetcher refuses or fails to fetch (its rule named), or more
            images than --limit-mm-per-prompt. `fetcher` None: remote URLs are refused.
    """
    if mm_processor is None:
        raise OpenAIServingError("messages: this model takes text only; image content parts "
                                 "need a vision-language model", 400, param="messages")
    if request.chat_template is not None or request.tools:
        raise OpenAIServingError("messages: image content parts cannot be combined with a "
                                 "request chat_template or tools yet", 400, param="messages")
    try:
        conversation = await _conversation(request, fetcher or MediaFetcher())
        text, images = mm_processor.render_chat(conversation, request.add_generation_prompt)
        # Decoding and resizing images is CPU work: off the event loop.
        return await asyncio.to_thread(mm_processor.process, text, images)
    except ValueError as e:
        raise OpenAIServingError(str(e), 400, param="messages") from None
