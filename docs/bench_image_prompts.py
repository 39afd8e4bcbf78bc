"""Image prompts: pagedllm vs HF transformers `generate` on a mid-size random Idefics3 (issue #42).

    PYTHONPATH=. python docs/bench_image_prompts.py ours   # then:  ... hf

8 prompts with one 200x150 image each (5 tiles of 128 px -> 80 image tokens, 113 prompt tokens),
32 greedy output tokens each, fp32. HF runs the 8 prompts as one padded batch; pagedllm as one
`LLM.generate` call. "encoder" times our vision tower + connector (`embed_multimodal`) on the
same 8 images in one batch, outside the engine (what the engine's encoder step runs).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from tests.fixtures.tokenizers import build_byte_level_tokenizer
from tests.fixtures.vlm import CHAT_TEMPLATE, IMAGE_TOKENS, draw_image

CHECKPOINT = Path("/tmp/pagedllm_bench_idefics3_mid")
N, OUT = 8, 32


def build() -> None:
    """ViT 6 x 384 over 128 px tiles of 16 px patches; Llama 8 x 512 (GQA 8/4): 44M params."""
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tok = AutoTokenizer.from_pretrained(build_byte_level_tokenizer(CHECKPOINT / "_tok"))
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
    Idefics3ForConditionalGeneration(cfg).save_pretrained(CHECKPOINT)
    proc.save_pretrained(CHECKPOINT)


def main(mode: str) -> None:
    if not (CHECKPOINT / "config.json").exists():
        build()
    images = [draw_image(200, 150, i) for i in range(N)]
    texts = [f"Picture {i}: <image> describe it" for i in range(N)]
    if mode == "hf":
        from transformers import AutoProcessor, Idefics3ForConditionalGeneration

        proc = AutoProcessor.from_pretrained(CHECKPOINT)
        proc.tokenizer.padding_side = "left"
        model = Idefics3ForConditionalGeneration.from_pretrained(CHECKPOINT,
                                                                 dtype=torch.float32).eval()
        inputs = proc(text=texts, images=[[im] for im in images], return_tensors="pt",
                      padding=True)
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=OUT, min_new_tokens=OUT, do_sample=False)
            elapsed = time.perf_counter() - start
        print(f"hf: {elapsed:.2f} s, {N * OUT / elapsed:.1f} output tok/s")
        return
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_loader.loader import load_model
    from transformers import AutoConfig

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
