"""Qwen2-VL / Qwen2.5-VL front end: the image processing without HF's processor, and the M-RoPE
positions of a prompt.

HF's `Qwen2_5_VLProcessor` builds a video processor that needs torchvision; images need only
the PIL image processor (`Qwen2VLImageProcessorPil`), the tokenizer and the chat template, so
`QwenVLProcessor` is those three. An image becomes `grid_t x grid_h x grid_w` patches (rows of
`pixel_values`, each `C * temporal_patch_size * patch^2` floats, in merge-block order) and
`grid_t * grid_h * grid_w / merge^2` `<|image_pad|>` tokens (one per merged 2x2 block), as
`Qwen2_5_VLProcessor.replace_image_token` expands them.

`mrope_input_positions` is HF's `Qwen2_5_VLModel.get_rope_index` (and vLLM's
`MRotaryEmbedding.get_input_positions`) for images: text tokens count up on all three rows;
an image's tokens take (start + t, start + h, start + w) over its merged grid; the text after
it starts at start + max(grid_h, grid_w) / merge. Decode positions continue at
`token index + mrope_position_delta`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.multimodal.inputs import MultiModalFeature

IMAGE_PAD = "<|image_pad|>"


class QwenVLProcessor:
    """The image half of HF's Qwen2.5-VL processor (the interface `MultiModalProcessor` uses).

    Args:
        image_processor: a `Qwen2VLImageProcessorPil`.
        tokenizer: the checkpoint's tokenizer (with `<|image_pad|>`).
        chat_template: the processor's chat template (None: the tokenizer's).
    """

    image_token = IMAGE_PAD

    def __init__(self, image_processor, tokenizer, chat_template: str | None = None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.merge_size = int(image_processor.merge_size)

    @classmethod
    def from_pretrained(cls, model_path: str, trust_remote_code: bool = False
                        ) -> QwenVLProcessor:
        """Load the image processor, tokenizer and chat template of a checkpoint folder or id.

        Raises:
            OSError / ValueError: from transformers, when a part cannot be loaded.
        """
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path,
                                                  trust_remote_code=trust_remote_code)
        template = None
        jinja = Path(model_path) / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text()
        return cls(image_processor, tokenizer, template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            tokenize: bool = False, chat_template: str | None = None) -> str:
        """The conversation rendered by the chat template (images as {"type": "image"} parts)."""
        return self.tokenizer.apply_chat_template(
            messages, chat_template=chat_template or self.chat_template, tokenize=tokenize,
            add_generation_prompt=add_generation_prompt)

    def __call__(self, text: list[str], images: list[list], return_tensors: str = "np",
                 add_special_tokens: bool = True) -> dict[str, np.ndarray]:
        """One prompt's text and images -> {"input_ids" [1, L], "pixel_values" [patches, D]
        float32, "image_grid_thw" [num_images, 3] int64}, each `<|image_pad|>` expanded to its
        image's token count (images in prompt order).

        Raises:
            ValueError: a placeholder count that differs from the images.
        """
        [prompt], [imgs] = text, images
        out = self.image_processor(images=imgs, return_tensors="np")
        grids = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        pieces = prompt.split(IMAGE_PAD)
        if len(pieces) != len(grids) + 1:
            raise ValueError(f"{len(pieces) - 1} {IMAGE_PAD} placeholders for {len(grids)} "
                             "images")
        counts = [int(g.prod()) // self.merge_size ** 2 for g in grids]
        expanded = pieces[0] + "".join(IMAGE_PAD * n + p for n, p in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids
        return {"input_ids": np.asarray([ids], dtype=np.int64),
                "pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
                "image_grid_thw": grids}


def qwen_vl_features(out: dict[str, np.ndarray], token_ids: list[int], image_token_id: int,
                     merge_size: int, make_hash) -> list[MultiModalFeature]:
    """One feature per image of a `QwenVLProcessor` output: the i-th run of `image_token_id`
    tokens with the i-th image's patches and grid ({"pixel_values" [t*h*w, D], "image_grid_thw"
    [3]}); `make_hash(data)` names the image (pixels and grid).

    Raises:
        ValueError: runs of placeholders that do not match the images' token counts.
    """
    ids = np.asarray(token_ids)
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    starts = np.nonzero(is_image[1:] & ~is_image[:-1])[0]
    ends = np.nonzero(~is_image[1:] & is_image[:-1])[0]
    grids, pixels = out["image_grid_thw"], out["pixel_values"]
    patches = grids.prod(axis=1)
    if len(starts) != len(grids) or len(pixels) != int(patches.sum()) or any(
            (end - start) * merge_size ** 2 != n for start, end, n in zip(starts, ends, patches)):
        raise ValueError(f"multi_modal_data: image placeholder runs of {(ends - starts).tolist()} "
                         f"tokens for images of {patches.tolist()} patches")
    features, row = [], 0
    for start, end, grid, n in zip(starts, ends, grids, patches):
        data = {"pixel_values": pixels[row:row + n], "image_grid_thw": grid.copy()}
        features.append(MultiModalFeature("image", make_hash(data), int(start),
                                          int(end - start), np.ones(end - start, dtype=bool),
                                          data))
        row += n
    return features


def mrope_input_positions(num_tokens: int, features: list[MultiModalFeature],
                          spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """The M-RoPE positions of a prompt and its decode offset.

    Args:
        num_tokens: prompt length.
        features: its images ("image_grid_thw" [3] in `data`), placeholder ranges disjoint.
        spatial_merge_size: patches merged per side into one token.

    Returns:
        (positions int64 [3, num_tokens] (t, h, w), mrope_position_delta: the token at index
        p >= num_tokens has position p + delta on all three rows).

    Raises:
        ValueError: an image whose range length is not its merged grid's size.
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    current, prev_end = 0, 0
    for f in sorted(features, key=lambda f: f.offset):
        text_len = f.offset - prev_end
        positions[:, prev_end:f.offset] = current + np.arange(text_len)
        current += text_len
        t, h, w = (int(x) for x in f.data["image_grid_thw"])
        lh, lw = h // spatial_merge_size, w // spatial_merge_size
        if t * lh * lw != f.length:
            raise ValueError(f"an image of grid {(t, h, w)} has {f.length} placeholders, "
                             f"expected {t * lh * lw}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        positions[:, f.offset:f.offset + f.length] = current + np.stack(
            [tt.ravel(), hh.ravel(), ww.ravel()])
        current += max(h, w) // spatial_merge_size
        prev_end = f.offset + f.length
    positions[:, prev_end:] = current + np.arange(num_tokens - prev_end)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
