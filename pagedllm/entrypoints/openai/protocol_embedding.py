"""Pydantic models of OpenAI's embeddings API (POST /v1/embeddings), plus vLLM's extra fields.

    input: "text" | ["text", ...] | [token ids] | [[token ids], ...]
    encoding_format: "float" (lists of floats) | "base64" (little-endian float32 bytes, base64)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import UsageInfo, _StrictModel, now_s, random_id


class EmbeddingRequest(_StrictModel):
    """OpenAI's fields, plus vLLM's `truncate_prompt_tokens` and `normalize` extras.

    Checked as the completion routes check their bodies (a 400 naming the field): unknown
    fields, values of the wrong JSON type (`true` is no token id, `"5"` no int), and text that
    is not valid Unicode (a lone surrogate, which no tokenizer takes) are refused.
    """

    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
