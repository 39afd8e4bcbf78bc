"""MultiModalProcessor: a prompt's text and images -> token ids with expanded image
placeholders + one `MultiModalFeature` per image, through the model's Hugging Face processor
(`AutoProcessor`: image processing, placeholder expansion, chat template).

It runs in the front end (the InputProcessor's admission), never in the engine loop. The
image processors are the `*ImageProcessorPil` ones (numpy/PIL; torchvision is not needed).
Per architecture, `_FAMILIES` says how many rows of the processor's `pixel_values` belong to
each image (Idefics3 / SmolVLM split an image into tiles plus a global view; Gemma 3 has one),
where the image token id is in the HF config, and whether the decoder attends an image's tokens
bidirectionally (Gemma 3: such an image is never split across prefill chunks). Qwen2.5-VL and
Qwen3-VL have their own processor (`multimodal/qwen_vl.py`: HF's needs torchvision) and splits its output by
each image's patch grid.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.config import MultiModalConfig
from pagedllm.multimodal.image import load_image
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.qwen_vl import QwenVLProcessor, qwen_vl_features


def _idefics3_tiles(hf_processor, images) -> list[int]:
    """Idefics3 / SmolVLM: rows x cols tiles + 1 global image when the image is split, else 1."""
    ip = hf_processor.image_processor
    return [max(1, ip.get_number_of_image_patches(im.height, im.width, {})[0]) for im in images]


def _one_tile(hf_processor, images) -> list[int]:
    return [1] * len(images)


@dataclass(frozen=True)
class _Family:
    """How a family's HF processor output maps onto images.

    tiles_per_image: (processor, PIL images) -> rows of pixel_values of each image.
    image_token_key: the HF config key of the placeholder token each embedding replaces.
    batched_pixels: pixel_values has a leading batch axis ([1, tiles, 3, H, W]), else
        [tiles, 3, H, W].
    bidirectional: the decoder attends an image's placeholders bidirectionally.
    load_processor: (model path, trust_remote_code) -> processor; None: `AutoProcessor`.
    make_features: (processor, its output, token ids, image token id) -> one feature per
        image; None: equal tiles of `tiles_per_image`.
    """

    tiles_per_image: Callable[[Any, list], list[int]]
    image_token_key: str
    batched_pixels: bool = True
    bidirectional: bool = False
    load_processor: Callable[[str, bool], Any] | None = None
    make_features: Callable[..., list[MultiModalFeature]] | None = None


def _qwen_vl_features(hf_processor, out, token_ids: list[int], image_token_id: int
                      ) -> list[MultiModalFeature]:
    return qwen_vl_features(out, token_ids, image_token_id, hf_processor.merge_size,
                            lambda data: image_hash(data["pixel_values"],
                                                    data["image_grid_thw"]))


_IDEFICS3 = _Family(_idefics3_tiles, "image_token_id")
_QWEN_VL = _Family(_one_tile, "image_token_id", load_processor=QwenVLProcessor.from_pretrained,
                   make_features=_qwen_vl_features)
_FAMILIES: dict[str, _Family] = {
    "Idefics3ForConditionalGeneration": _IDEFICS3,
    "SmolVLMForConditionalGeneration": _IDEFICS3,
    "Gemma3ForConditionalGeneration": _Family(_one_tile, "image_token_index",
                                              batched_pixels=False, bidirectional=True),
    "Qwen2VLForConditionalGeneration": _QWEN_VL,
    "Qwen2_5_VLForConditionalGeneration": _QWEN_VL,
    "Qwen3VLForConditionalGeneration": _QWEN_VL,
}


def multimodal_architecture(architectures: Sequence[str]) -> str | None:
    """The first of `architectures` that takes images here (None: a text-only model)."""
    return next((a for a in architectures if a in _FAMILIES), None)


def image_hash(pixel_values: np.ndarray, grid: np.ndarray | None = None) -> str:
    """Hex SHA-256 of an image's encoder inputs (shape, float32 bytes and the patch grid, where
    the shape alone does not fix the image's layout)."""
    h = hashlib.sha256(repr(pixel_values.shape).encode())
    if grid is not None:
        h.update(repr(np.asarray(grid).tolist()).encode())
    h.update(np.ascontiguousarray(pixel_values, dtype=np.float32).tobytes())
    return h.hexdigest()


class MultiModalProcessor:
    """The model's HF processor behind the engine's checks.

    Args:
        hf_processor: the checkpoint's `AutoProcessor` (with a PIL image processor).
        architecture: the model's architecture (a key of `_FAMILIES`).
        image_token_id: the placeholder token each image embedding replaces.
        config: limits (images per prompt, pixels per image).
    """

    def __init__(self, hf_processor, architecture: str, image_token_id: int,
                 config: MultiModalConfig) -> None:
        self.hf_processor = hf_processor
        self.family = _FAMILIES[architecture]
        self.image_token_id = image_token_id
        self.image_token: str = hf_processor.image_token
        self.config = config

    @classmethod
    def from_pretrained(cls, model_path: str, hf_config: dict[str, Any],
                        config: MultiModalConfig, trust_remote_code: bool = False
                        ) -> MultiModalProcessor | None:
        """The processor of a vision-language checkpoint; None for a text-only model.

        Raises:
            ValueError: the checkpoint has no loadable processor.
        """
        arch = multimodal_architecture(hf_config.get("architectures") or ())
        if arch is None:
            return None
        from transformers import AutoProcessor
        load = _FAMILIES[arch].load_processor or (
            lambda path, trust: AutoProcessor.from_pretrained(path, trust_remote_code=trust))
        try:
            hf_processor = load(model_path, trust_remote_code)
        except Exception as e:  # noqa: BLE001 - named in the message
            raise ValueError(f"could not load the image processor of {model_path}: {e}") from e
        return cls(hf_processor, arch, int(hf_config[_FAMILIES[arch].image_token_key]), config)

    def load_images(self, images: Any) -> list:
        """PIL RGB images from one image or a list (`load_image`), within the prompt limit.

        Raises:
            ValueError: (naming multi_modal_data) too many images, or a bad image.
        """
        if not isinstance(images, (list, tuple)):
            images = [images]
        limit = self.config.limit_per_prompt.get("image", 0)
        if len(images) > limit:
            raise ValueError(f"multi_modal_data: {len(images)} images is more than the limit "
                             f"of {limit} per prompt (--limit-mm-per-prompt)")
        return [load_image(im, self.config.max_image_pixels, f"multi_modal_data: image {i}")
                for i, im in enumerate(images)]

    def process(self, text: str, images: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand `text`'s image placeholders (one `image_token` per image, in order) and
        preprocess the images.

        Returns:
            (prompt token ids, one feature per image in prompt order).

        Raises:
            ValueError: naming the problem (placeholder count, bad image, limits).
        """
        images = self.load_images(images)
        if not isinstance(text, str):
            raise ValueError("prompt: a prompt with images must be text")
        num_placeholders = text.count(self.image_token)
        if num_placeholders != len(images):
            raise ValueError(f"prompt: has {num_placeholders} image placeholder(s) "
                             f"{self.image_token!r} for {len(images)} image(s); put one where "
                             "each image goes")
        tokenizer = self.hf_processor.tokenizer
        bos = tokenizer.bos_token
        # As HF's processor chat path: a rendered prompt that starts with BOS gets no second.
        add_special = not (bos is not None and text.startswith(bos))
        if not images:
            return list(tokenizer(text, add_special_tokens=add_special).input_ids), []
        try:
            out = self.hf_processor(text=[text], images=[images], return_tensors="np",
                                    add_special_tokens=add_special)
        except Exception as e:  # noqa: BLE001 - the processor refused this input
            raise ValueError(f"multi_modal_data: the image processor failed: {e}") from None
        token_ids = [int(t) for t in out["input_ids"][0]]
        if self.family.make_features is not None:
            return token_ids, self.family.make_features(self.hf_processor, out, token_ids,
                                                        self.image_token_id)
        pixel_values = np.asarray(out["pixel_values"], dtype=np.float32)
        if self.family.batched_pixels:
            pixel_values = pixel_values[0]
        return token_ids, self._features(token_ids, pixel_values,
                                         self.family.tiles_per_image(self.hf_processor, images))

    def _features(self, token_ids: list[int], pixel_values: np.ndarray,
                  tiles: list[int]) -> list[MultiModalFeature]:
        """Split the prompt's image tokens and the pixel tiles image by image."""
        ids = np.asarray(token_ids)
        positions = np.nonzero(ids == self.image_token_id)[0]
        if sum(tiles) != len(pixel_values) or len(positions) % max(1, sum(tiles)):
            raise ValueError(f"multi_modal_data: the processor gave {len(pixel_values)} tiles "
                             f"and {len(positions)} image tokens for images of {tiles} tiles")
        per_tile = len(positions) // sum(tiles)
        features, tile0, tok0 = [], 0, 0
        for n in tiles:
            pos = positions[tok0:tok0 + n * per_tile]
            offset, length = int(pos[0]), int(pos[-1] - pos[0] + 1)
            data = {"pixel_values": pixel_values[tile0:tile0 + n]}
            features.append(MultiModalFeature(
                "image", image_hash(data["pixel_values"]), offset, length,
                ids[offset:offset + length] == self.image_token_id, data,
                bidirectional=self.family.bidirectional))
            tile0, tok0 = tile0 + n, tok0 + n * per_tile
        return features

    def render_chat(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> tuple[str, list]:
        """A conversation with OpenAI content parts rendered by the processor's chat template.

        Parts: {"type": "text", "text"}, {"type": "image_url", "image_url": {"url": data URL}}
        (or the URL string), {"type": "image_pil", "image_pil": PIL image} and {"type":
        "image", "image": any `load_image` input}.

        Returns:
            (prompt text with one image placeholder per image, the images in order).

        Raises:
            ValueError: an unknown part type or a malformed part (naming messages).
        """
        messages, images = [], []
        for m in conversation:
            content = m.get("content")
            if isinstance(content, str) or content is None:
                messages.append(m)
                continue
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif kind in ("image_url", "image_pil", "image"):
                    value = part.get(kind)
                    if kind == "image_url":
                        value = value.get("url") if isinstance(value, dict) else value
                    if value is None:
                        raise ValueError(f"messages: a {kind!r} part needs a {kind!r} field")
                    images.append(value)
                    parts.append({"type": "image"})
                else:
                    raise ValueError(f"messages: unsupported content part type {kind!r}")
            messages.append({**m, "content": parts})
        template = chat_template or self.hf_processor.chat_template
        try:
            text = self.hf_processor.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                chat_template=template)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise ValueError(f"messages: could not render the chat template: {e}") from None
        return text, images
