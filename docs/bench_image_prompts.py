"""Image prompts: pagedllm vs HF transformers `generate` on a mid-size random vision-language
model (issue #42).

    PYTHONPATH=. python docs/bench_image_prompts.py idefics3 ours   # then:  ... idefics3 hf
    PYTHONPATH=. python docs/bench_image_prompts.py qwen2_5_vl ours # then:  ... qwen2_5_vl hf

8 prompts with one image each, 32 greedy output tokens each, fp32. HF runs the 8 prompts as
one left-padded batch; pagedllm as one `LLM.generate` call. "encoder" times our vision tower +
connector (`embed_multimodal`) on the same 8 images in one batch, outside the engine (what the
engine's encoder step runs). The models (random weights, built once under /tmp):

* idefics3: ViT 6 x 384 over 128 px tiles of 16 px patches, pixel shuffle 2, Llama 8 x 512
  (GQA 8/4), 44M parameters; 200x150 images (5 tiles -> 80 image tokens, 113 prompt tokens).
* qwen2_5_vl: ViT 6 x 384 (14 px patches, 2x2 merge, 112 px windows, blocks 2 and 5 over the
  whole image), Qwen2 decoder 8 x 512 (GQA 8/4, mrope_section [8, 12, 12]), 50M parameters;
  224x168 images (16 x 12 patches -> 48 image tokens). HF's inputs carry `mm_token_type_ids`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tests.fixtures.qwen_vl import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_TOKENS
from tests.fixtures.tokenizers import build_byte_level_tokenizer
from tests.fixtures.vlm import CHAT_TEMPLATE, IMAGE_TOKENS, draw_image

N, OUT = 8, 32


def build_idefics3(checkpoint: Path) -> None:
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tok = AutoTokenizer.from_pretrained(build_byte_level_tokenizer(checkpoint / "_tok"))
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    proc = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(
        size={"longest_edge": 256}, max_image_size={"longest_edge": 128}), tokenizer=tok,
        image_seq_len=16, chat_template=CHAT_TEMPLATE)
    cfg = Idefics3Config(
        vision_config=dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                           num_attention_heads=6, image_size=128, patch_size=16),
        text_config=dict(model_type="llama", hidden_size=512, intermediate_size=2048,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         vocab_size=len(tok), max_position_embeddings=1024),
        image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(cfg).save_pretrained(checkpoint)
    proc.save_pretrained(checkpoint)


def idefics3_hf_inputs(checkpoint: Path, texts: list[str], images: list) -> dict:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(checkpoint)
    proc.tokenizer.padding_side = "left"
    return dict(proc(text=texts, images=[[im] for im in images], return_tensors="pt",
                     padding=True))


def qwen_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    return Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2,
                                    min_pixels=56 * 56, max_pixels=448 * 448)


def build_qwen2_5_vl(checkpoint: Path) -> None:
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(build_byte_level_tokenizer(checkpoint / "_tok"))
    tok.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=len(tok),
                         max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=6, hidden_size=384, intermediate_size=1536, num_heads=6,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=[2, 5], out_hidden_size=512),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(checkpoint)
    tok.save_pretrained(checkpoint)
    qwen_image_processor().save_pretrained(checkpoint)
    (checkpoint / "chat_template.jinja").write_text(QWEN_VL_CHAT_TEMPLATE)


def qwen_vl_hf_inputs(checkpoint: Path, texts: list[str], images: list) -> dict:
    """One left-padded batch: placeholders expanded by the grids, mm_token_type_ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    out = qwen_image_processor()(images=images, return_tensors="pt")
    rows = []
    for text, grid in zip(texts, out["image_grid_thw"]):
        text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // 4))
        rows.append(tok(text).input_ids)
    width = max(map(len, rows))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "attention_mask": mask,
            "mm_token_type_ids": (ids == image_id).int(),
            "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@dataclass(frozen=True)
class Preset:
    checkpoint: Path
    hf_class: str                    # transformers' class name
    placeholder: str                 # one image in a prompt's text
    image_size: tuple[int, int]      # (width, height) px
    build: Callable[[Path], None]
    hf_inputs: Callable[[Path, list[str], list], dict]


PRESETS = {
    "idefics3": Preset(Path("/tmp/pagedllm_bench_idefics3_mid"),
                       "Idefics3ForConditionalGeneration", "<image>", (200, 150),
                       build_idefics3, idefics3_hf_inputs),
    "qwen2_5_vl": Preset(Path("/tmp/pagedllm_bench_qwen2_5_vl_mid"),
                         "Qwen2_5_VLForConditionalGeneration",
                         "<|vision_start|><|image_pad|><|vision_end|>", (224, 168),
                         build_qwen2_5_vl, qwen_vl_hf_inputs),
}


def run_hf(preset: Preset, texts: list[str], images: list) -> None:
    import transformers

    model = getattr(transformers, preset.hf_class).from_pretrained(
        preset.checkpoint, dtype=torch.float32).eval()
    inputs = preset.hf_inputs(preset.checkpoint, texts, images)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=OUT, min_new_tokens=OUT, do_sample=False)
        elapsed = time.perf_counter() - start
    print(f"hf: {elapsed:.2f} s, {N * OUT / elapsed:.1f} output tok/s")


def run_ours(preset: Preset, texts: list[str], images: list) -> None:
    from transformers import AutoConfig

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_loader.loader import load_model

    path = str(preset.checkpoint)
    llm = LLM(path, dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    elapsed = time.perf_counter() - start
    mm = llm.llm_engine.input_processor.mm_processor
    features = [mm.process(t, im)[1][0] for t, im in zip(texts, images)]
    model = load_model(path, AutoConfig.from_pretrained(path), torch.float32,
                       torch.device("cpu"))
    with torch.inference_mode():
        model.embed_multimodal([f.data for f in features[:1]])
        t0 = time.perf_counter()
        model.embed_multimodal([f.data for f in features])
        encoder = time.perf_counter() - t0
    print(f"ours: {elapsed:.2f} s, {N * OUT / elapsed:.1f} output tok/s; encoder (8 images, "
          f"one batch) {encoder:.2f} s = {encoder / elapsed:.0%} of the generate call")


def main(model: str, mode: str) -> None:
    if model not in PRESETS or mode not in ("ours", "hf"):
        sys.exit(f"usage: bench_image_prompts.py {{{'|'.join(PRESETS)}}} {{ours|hf}}")
    preset = PRESETS[model]
    if not (preset.checkpoint / "config.json").exists():
        preset.build(preset.checkpoint)
    images = [draw_image(*preset.image_size, i) for i in range(N)]
    texts = [f"Picture {i}: {preset.placeholder} describe it" for i in range(N)]
    (run_hf if mode == "hf" else run_ours)(preset, texts, images)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "idefics3", args[1] if len(args) > 1 else "ours")
