"""PoolingParams: how one embedding request is pooled (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass(frozen=True)
class PoolingParams:
    """Per-request pooling options; None fields fall back to the model's defaults.

    Attributes:
        pooling_type: "MEAN" (average over the prompt's tokens), "CLS" (first token) or "LAST"
            (last token); case-insensitive.
        normalize: L2-normalise the pooled vector.
        truncate_prompt_tokens: keep at most this many prompt tokens (-1 = the engine's
            max_model_len); None = an over-long prompt is an error. Text prompts are truncated by
            the tokenizer (special tokens kept, as sentence-transformers does); token-id prompts
            keep their first tokens.

    Raises:
        ValueError: for an unknown pooling_type or truncate_prompt_tokens < -1 or == 0.
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            upper = self.pooling_type.upper()
            if upper not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, "
                                 f"got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", upper)
        t = self.truncate_prompt_tokens
        if t is not None and (t < -1 or t == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {t}")
