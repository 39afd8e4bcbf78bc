"""Random-weight vision-language checkpoints for `pagedllm bench images`, built once into the
preset cache (`presets.default_preset_root()`), each with its tokenizer and image processor
saved beside the weights so it loads offline.

* `smolvlm-200m`: SmolVLM-256M's layout (Idefics3 classes) at 256 px: a SigLIP-style ViT of
  12 x 768 over 16 px patches (256 patches per 256 px tile, 86M parameters), pixel shuffle 2
  (64 image tokens per tile) into a SmolLM2-135M-shaped Llama decoder cut to 24 layers
  (576 wide, GQA 9/3 heads of 64, MLP 1536, untied 32k vocabulary): 211M parameters, 41% in
  the vision tower (SmolVLM-256M: 93M of 256M). Images are resized to a longest edge of 256
  px and not split: one tile, 64 image tokens per image.
* `qwen2.5-vl-200m`: Qwen2.5-VL's layout: a ViT of 12 x 768 (14 px patches, 2x2 merge, 112 px
  windows, blocks 2, 5, 8 and 11 over the whole image, gated MLP 2048) into a Qwen2 decoder
  of 16 x 640 (GQA 10/2 heads of 64, MLP 1728, M-RoPE sections [8, 12, 12], untied 32k
  vocabulary): 207M parameters, 46% in the ViT and merger. Images of up to 224 x 224 px
  (256 patches, 64 image tokens).
* `smolvlm-tiny`, `qwen2.5-vl-tiny`: the same classes a few hundred kB large, for tests.

The tokenizer is the presets' synthetic byte-level BPE with the family's image tokens added
(vocabulary = config vocabulary). Weights are seeded and saved in float32 (the engine casts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.benchmarks.presets import build_once, default_preset_root, write_synthetic_tokenizer

# Idefics3 / SmolVLM's image tokens (the processor's tile markers and the placeholder).
IDEFICS3_IMAGE_TOKENS = (["<image>", "<fake_token_around_image>", "<global-img>",
                          "<end_of_utterance>"]
                         + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
QWEN_VL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]


@dataclass(frozen=True)
class VLMPreset:
    """One vision-language preset.

    `family` is "idefics3" or "qwen2_5_vl"; `vision` / `text` are the config's sub-configs,
    `processor` the image processor's arguments; `image_size` the (width, height) in px of the
    benchmark's drawn images; `vocab_size` the model's vocabulary (image tokens included).
    """

    family: str
    vision: dict[str, Any]
    text: dict[str, Any]
    processor: dict[str, Any]
    image_size: tuple[int, int]
    vocab_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def placeholder(self) -> str:
        """One image in a prompt's text (the processor expands it)."""
        return ("<image>" if self.family == "idefics3"
                else "<|vision_start|><|image_pad|><|vision_end|>")

    @property
    def hf_class(self) -> str:
        return ("Idefics3ForConditionalGeneration" if self.family == "idefics3"
                else "Qwen2_5_VLForConditionalGeneration")


VLM_PRESETS: dict[str, VLMPreset] = {
    "smolvlm-200m": VLMPreset(
        "idefics3",
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, image_size=256, patch_size=16),
        text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=24,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048),
        processor=dict(size={"longest_edge": 256}, max_image_size={"longest_edge": 256},
                       do_image_splitting=False, image_seq_len=64),
        image_size=(256, 192), vocab_size=32000, extra=dict(scale_factor=2)),
    "smolvlm-tiny": VLMPreset(
        "idefics3",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, image_size=32, patch_size=8),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
        processor=dict(size={"longest_edge": 32}, max_image_size={"longest_edge": 32},
                       do_image_splitting=False, image_seq_len=4),
        image_size=(40, 30), vocab_size=1024, extra=dict(scale_factor=2)),
    "qwen2.5-vl-200m": VLMPreset(
        "qwen2_5_vl",
        vision=dict(depth=12, hidden_size=768, intermediate_size=2048, num_heads=12,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[2, 5, 8, 11], out_hidden_size=640),
        text=dict(hidden_size=640, intermediate_size=1728, num_hidden_layers=16,
                  num_attention_heads=10, num_key_value_heads=2, max_position_embeddings=2048,
                  rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                                   "rope_theta": 10000.0}),
        processor=dict(patch_size=14, temporal_patch_size=2, merge_size=2,
                       min_pixels=56 * 56, max_pixels=224 * 224),
        image_size=(224, 224), vocab_size=32000),
    "qwen2.5-vl-tiny": VLMPreset(
        "qwen2_5_vl",
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                    fullatt_block_indexes=[1], out_hidden_size=64),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                   "rope_theta": 10000.0}),
        processor=dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                       max_pixels=32 * 32),
        image_size=(32, 24), vocab_size=1024),
}


def vlm_preset_path(name: str, root: str | Path | None = None, seed: int = 0) -> str:
    """Folder of vision-language preset `name` (float32 weights), built if missing.

    Raises:
        ValueError: for an unknown preset, naming the known ones.
    """
    if name not in VLM_PRESETS:
        raise ValueError(f"unknown image preset {name!r}; known: {sorted(VLM_PRESETS)}")
    root = Path(root) if root is not None else default_preset_root()
    return build_once(root / f"{name}-float32",
                      lambda tmp: build_vlm_checkpoint(tmp, VLM_PRESETS[name], seed),
                      {"preset": name, "dtype": "float32"})


def _tokenizer(out_dir: Path, base_vocab: int, added: list[str]):
    from transformers import AutoTokenizer

    (out_dir / "_tokenizer").mkdir()
    tok_dir = write_synthetic_tokenizer(out_dir / "_tokenizer", base_vocab)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": added})
    return tokenizer


def qwen_vl_image_processor(preset: VLMPreset):
    """The preset's `Qwen2VLImageProcessorPil` (Qwen2.5-VL uses Qwen2-VL's image processor)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    return Qwen2VLImageProcessorPil(**preset.processor)


def build_vlm_checkpoint(out_dir: str | Path, preset: VLMPreset, seed: int = 0) -> Path:
    """Save `preset`'s seeded random model, tokenizer and image processor into `out_dir`."""
    import shutil

    import torch
    import transformers
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    added = IDEFICS3_IMAGE_TOKENS if preset.family == "idefics3" else QWEN_VL_TOKENS
    tokenizer = _tokenizer(out_dir, preset.vocab_size - len(added), added)
    assert len(tokenizer) == preset.vocab_size, (len(tokenizer), preset.vocab_size)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    text = dict(preset.text, vocab_size=preset.vocab_size, tie_word_embeddings=False,
                rms_norm_eps=1e-5, **ids)
    if preset.family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil)
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

        proc_args = dict(preset.processor)
        image_seq_len = proc_args.pop("image_seq_len")
        config = transformers.Idefics3Config(
            vision_config=preset.vision, text_config=dict(text, model_type="llama"),
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            tie_word_embeddings=False, **preset.extra)
        saved = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**proc_args),
                                  tokenizer=tokenizer, image_seq_len=image_seq_len)
    else:
        tok = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=preset.vision, tie_word_embeddings=False,
            image_token_id=tok["<|image_pad|>"], video_token_id=tok["<|video_pad|>"],
            vision_start_token_id=tok["<|vision_start|>"],
            vision_end_token_id=tok["<|vision_end|>"], **preset.extra)
        qwen_vl_image_processor(preset).save_pretrained(out_dir)
        saved = tokenizer
    config.architectures = [preset.hf_class]
    torch.manual_seed(seed)
    model = getattr(transformers, preset.hf_class)(config).eval()
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out_dir)
    saved.save_pretrained(out_dir)
    shutil.rmtree(out_dir / "_tokenizer")
    return out_dir


def draw_image(width: int, height: int, seed: int):
    """A PIL RGB image of `width` x `height` px: random coloured rectangles on a random
    background, a pure function of `seed` (never uniform grey, which Idefics3 would take for a
    padding tile)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(0, 255, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(1, width)), y0 + int(rng.integers(1, height))
        draw.rectangle([x0, y0, x1, y1], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return image
