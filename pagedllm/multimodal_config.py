"""Image-input config of vision-language models: `MultiModalConfig`.

Split out of `pagedllm.config` (which re-exports it); see docs/multimodal.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MultiModalConfig:
    """Image inputs (docs/multimodal.md); read only by engines of vision-language models.

    Attributes:
        limit_per_prompt: most items of each modality in one prompt (vLLM's
            `--limit-mm-per-prompt`), e.g. {"image": 4}.
        max_image_pixels: most pixels (width x height) of one decoded image: a larger image
            (a decompression bomb among them) is refused before its pixels are decoded.
        max_num_encoder_input_tokens: most image embeddings the encoder computes in one step
            (vLLM's name, the encoder's token budget).
        encoder_cache_size: most image embeddings (in tokens) kept between steps; an image
            with more embeddings than this is refused at admission.
    """

    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 4})
    max_image_pixels: int = 1 << 25
    max_num_encoder_input_tokens: int = 8192
    encoder_cache_size: int = 8192

    def __post_init__(self) -> None:
        for modality, limit in self.limit_per_prompt.items():
            if modality != "image":
                raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r} (only "
                                 "'image' is supported)")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt: the limit of {modality!r} must be an "
                                 f"int >= 0, got {limit!r}")
        for name in ("max_image_pixels", "max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.encoder_cache_size < self.max_num_encoder_input_tokens:
            raise ValueError(f"encoder_cache_size ({self.encoder_cache_size}) must be >= "
                             f"max_num_encoder_input_tokens ({self.max_num_encoder_input_tokens})")
