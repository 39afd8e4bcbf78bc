"""Fixtures of the image-input tests: one tiny Idefics3 checkpoint (with its processor) per
session, and the HF greedy tokens of the shared prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.vlm import build_tiny_idefics3, draw_image

MAX_TOKENS = 8


def vlm_prompts() -> list[tuple[str, list]]:
    """Prompts with 0, 1 and 2 images of different sizes (5 + 3 tiles: 20 and 12 embeddings)."""
    wide, tall = draw_image(56, 40, 1), draw_image(64, 16, 2)
    return [("The cat <image> sees", [wide]),
            ("A <image> and <image> too", [wide, tall]),
            ("Just some text here", []),
            ("<image> a tall one", [tall])]


def as_engine_prompt(text: str, images: list):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"))


@pytest.fixture(scope="session")
def hf_idefics3_tokens(tiny_idefics3: Path) -> list[list[int]]:
    """HF transformers' greedy tokens (fp32) of `vlm_prompts()`."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_idefics3)
    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3,
                                                             dtype=torch.float32).eval()
    out = []
    for text, images in vlm_prompts():
        inputs = processor(text=[text], images=[images] if images else None,
                           return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out
