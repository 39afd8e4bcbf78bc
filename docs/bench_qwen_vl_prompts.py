"""Image prompts on Qwen2.5-VL: pagedllm vs HF transformers `generate` (issue #42).

    PYTHONPATH=. python docs/bench_qwen_vl_prompts.py ours   # then:  ... hf

A random Qwen2.5-VL: ViT 6 x 384 (14 px patches, 2x2 merge, 112 px windows, blocks 2 and 5
over the whole image), Qwen2 decoder 8 x 512 (GQA 8/4, mrope_section [8, 12, 12]). 8 prompts
with one 224x168 image each (16 x 12 patches -> 48 image tokens), 32 greedy output tokens each,
fp32. HF runs the 8 prompts as one left-padded batch (with `mm_token_type_ids`); pagedllm as
one `LLM.generate` call. "encoder" times our ViT (`embed_multimodal`) on the same 8 images in
one batch, outside the engine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from tests.fixtures.qwen_vl import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_TOKENS
from tests.fixtures.tokenizers import build_byte_level_tokenizer
from tests.fixtures.vlm import draw_image

CHECKPOINT = Path("/tmp/pagedllm_bench_qwen2_5_vl_mid")
N, OUT = 8, 32
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    return Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2,
                                    min_pixels=56 * 56, max_pixels=448 * 448)


def build() -> None:
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(build_byte_level_tokenizer(CHECKPOINT / "_tok"))
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
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(CHECKPOINT)
    tok.save_pretrained(CHECKPOINT)
    image_processor().save_pretrained(CHECKPOINT)
    (CHECKPOINT / "chat_template.jinja").write_text(QWEN_VL_CHAT_TEMPLATE)


def hf_batch(texts, images) -> dict:
    """One left-padded batch: placeholders expanded by the grids, mm_token_type_ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CHECKPOINT)
    out = image_processor()(images=images, return_tensors="pt")
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


def main(mode: str) -> None:
    if not (CHECKPOINT / "config.json").exists():
        build()
    images = [draw_image(224, 168, i) for i in range(N)]
    texts = [f"Picture {i}: {IMAGE} describe it" for i in range(N)]
    if mode == "hf":
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            CHECKPOINT, dtype=torch.float32).eval()
        inputs = hf_batch(texts, images)
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=OUT, min_new_tokens=OUT, do_sample=False)
            elapsed = time.perf_counter() - start
        print(f"hf: {elapsed:.2f} s, {N * OUT / elapsed:.1f} output tok/s")
        return
    from transformers import AutoConfig

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_loader.loader import load_model

    llm = LLM(str(CHECKPOINT), dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    elapsed = time.perf_counter() - start
    mm = llm.llm_engine.input_processor.mm_processor
    features = [mm.process(t, im)[1][0] for t, im in zip(texts, images)]
    model = load_model(str(CHECKPOINT), AutoConfig.from_pretrained(CHECKPOINT), torch.float32,
                       torch.device("cpu"))
    with torch.inference_mode():
        model.embed_multimodal([f.data for f in features[:1]])
        t0 = time.perf_counter()
        model.embed_multimodal([f.data for f in features])
        encoder = time.perf_counter() - t0
    print(f"ours: {elapsed:.2f} s, {N * OUT / elapsed:.1f} output tok/s; encoder (8 images, "
          f"one batch) {encoder:.2f} s = {encoder / elapsed:.0%} of the generate call")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ours")
