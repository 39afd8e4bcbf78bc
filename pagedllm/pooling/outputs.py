"""Results of embedding requests (vLLM's `EmbeddingRequestOutput` shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmbeddingOutput:
    """embedding: the pooled (and, if asked, L2-normalised) vector as float32 values."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One embedding request as the user sees it.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt text (None when given as token ids).
        prompt_token_ids: the token ids that were embedded (after truncation).
        outputs: the embedding.
        finished: always True (embeddings are produced in one step).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
