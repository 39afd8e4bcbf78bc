"""`pagedllm bench images`: image prompts through the engine and through HF `generate`.

The workload: `--num-prompts` prompts `"Picture {i}: <placeholder> describe it"`, each with one
image of `--image-size` px drawn from seed `--seed + i` (`vlm_presets.draw_image`: coloured
rectangles), `--output-len` greedy output tokens each (EOS ignored). The engine gets them in one
`LLM.generate` call (all requests in flight at once, after a one-image warm-up); HF
`generate` gets the same texts and images in left-padded static batches of `--hf-batch-size`
(default all), processed by the checkpoint's own processor, greedy with `min_new_tokens =
max_new_tokens`. Both clocks cover generation only (HF's clock includes its image processing,
which the engine does in `generate`'s front end too).

Reported: output tokens/s of both, the ratio, greedy agreement, and the encoder's share of the
engine's time: the vision tower + connector's wall seconds (`Worker.encoder_stats`, counted in
the worker's `EncoderRunner` around `embed_multimodal`) over the timed `generate` call.

The model: `--preset` (`vlm_presets.VLM_PRESETS`, built on first use) or `--model` (an
Idefics3 / SmolVLM or Qwen2.5-VL checkpoint with its processor).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

_FAMILIES = {"Idefics3ForConditionalGeneration": "idefics3",
             "SmolVLMForConditionalGeneration": "idefics3",
             "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
_PLACEHOLDERS = {"idefics3": "<image>",
                 "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def add_images_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench images` on the `bench` sub-parsers."""
    from pagedllm.engine.arg_utils import add_engine_args

    p = sub.add_parser("images", help="image prompts (a vision-language model) through the "
                                      "engine and HF generate; tokens/s, ratio, encoder share")
    add_engine_args(p)
    g = p.add_argument_group("model and workload (seeded by --seed)")
    g.add_argument("--preset", default=None,
                   help="random-weight vision-language model by name (smolvlm-200m, "
                        "qwen2.5-vl-200m, smolvlm-tiny, qwen2.5-vl-tiny); wins over --model")
    g.add_argument("--preset-dir", default=None,
                   help="preset cache (default $PAGEDLLM_PRESET_DIR or ~/.cache/pagedllm/presets)")
    g.add_argument("--num-prompts", type=int, default=8,
                   help="image prompts, all sent at once (default 8)")
    g.add_argument("--output-len", type=int, default=32,
                   help="greedy output tokens per prompt (default 32)")
    g.add_argument("--image-size", default=None, metavar="WxH",
                   help="drawn image size in px (default: the preset's; 256x192 with --model)")
    p.add_argument("--compare", action="append", choices=["hf"], default=[],
                   help="also run the same prompts through HF transformers generate")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size of the HF baseline (default: all prompts)")
    p.add_argument("--output-json", default=None, help="save the results as JSON here")
    p.set_defaults(func=run_images_command)
    return p


def parse_image_size(text: str) -> tuple[int, int]:
    """"256x192" -> (256, 192). Raises ValueError naming the flag otherwise."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size must be WxH in px, e.g. 256x192; got {text!r}") from None
    if width < 1 or height < 1:
        raise ValueError(f"--image-size must be positive, got {text!r}")
    return width, height


def model_family(model_path: str) -> str:
    """"idefics3" or "qwen2_5_vl" from the checkpoint's `architectures`.

    Raises:
        ValueError: a model of another architecture, naming the supported ones.
    """
    config = json.loads((Path(model_path) / "config.json").read_text())
    for arch in config.get("architectures") or []:
        if arch in _FAMILIES:
            return _FAMILIES[arch]
    raise ValueError(f"bench images supports {sorted(_FAMILIES)}; {model_path} is "
                     f"{config.get('architectures')}")


def image_workload(family: str, num_prompts: int, image_size: tuple[int, int],
                   seed: int) -> tuple[list[str], list]:
    """(prompt texts, PIL images): prompt i holds one placeholder and image `seed + i`."""
    from pagedllm.benchmarks.vlm_presets import draw_image

    texts = [f"Picture {i}: {_PLACEHOLDERS[family]} describe it" for i in range(num_prompts)]
    return texts, [draw_image(*image_size, seed + i) for i in range(num_prompts)]


def _encoder_stats(llm) -> dict[str, float]:
    stats = llm.collective_rpc("encoder_stats")[0]
    if stats is None:
        raise ValueError("bench images needs a vision-language model; this one has no encoder")
    return stats


def run_engine_images(llm, texts: list[str], images: list, output_len: int,
                      seed: int) -> tuple[dict[str, Any], list[list[int]]]:
    """Time `llm.generate` over the image prompts (after a one-image warm-up; `seed` is the
    workload's, images `seed + i`); returns
    (figures, output token ids per prompt). Figures: as `throughput_figures` plus
    `encoder_s`, `encoder_share` (of the timed call), `num_encoded_images` and
    `num_encoder_batches` of the timed call."""
    from pagedllm import SamplingParams
    from pagedllm.benchmarks.report import PeakRSSMonitor
    from pagedllm.benchmarks.throughput import throughput_figures
    from pagedllm.benchmarks.vlm_presets import draw_image
    from pagedllm.benchmarks.workload import BenchRequest

    warm = draw_image(*images[0].size, seed + len(images))   # an image the workload lacks
    llm.generate([{"prompt": "Warm-up " + texts[0], "multi_modal_data": {"image": warm}}],
                 SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = _encoder_stats(llm)
    with PeakRSSMonitor() as mem:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    after = _encoder_stats(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    requests = [BenchRequest(list(o.prompt_token_ids), output_len) for o in outputs]
    figures = throughput_figures("pagedllm", requests, tokens, elapsed, mem.peak_bytes)
    encoder_s = after["encoder_time_s"] - before["encoder_time_s"]
    figures.update(encoder_s=encoder_s, encoder_share=encoder_s / elapsed,
                   num_encoded_images=after["num_encoded_images"] - before["num_encoded_images"],
                   num_encoder_batches=(after["num_encoder_batches"]
                                        - before["num_encoder_batches"]))
    return figures, tokens


def hf_image_inputs(family: str, model_path: str, texts: list[str], images: list) -> dict:
    """One left-padded HF batch of `texts` with one image each, as the checkpoint's processor
    makes it. Qwen2.5-VL: its image processor and tokenizer (the full processor would need a
    video processor), placeholders expanded by the image grids, plus `mm_token_type_ids`."""
    import torch
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if family == "idefics3":
        proc = AutoProcessor.from_pretrained(model_path)
        proc.tokenizer.padding_side = "left"
        return dict(proc(text=texts, images=[[im] for im in images], return_tensors="pt",
                         padding=True))
    tok = AutoTokenizer.from_pretrained(model_path)
    image_proc = AutoImageProcessor.from_pretrained(model_path)
    out = image_proc(images=images, return_tensors="pt")
    merge = image_proc.merge_size ** 2
    rows = []
    for text, grid in zip(texts, out["image_grid_thw"]):
        text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // merge))
        rows.append(tok(text).input_ids)
    width = max(map(len, rows))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "attention_mask": mask,
            "mm_token_type_ids": (ids == image_id).int(),
            "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def run_hf_images(family: str, model_path: str, texts: list[str], images: list,
                  output_len: int, batch_size: int, dtype) -> tuple[dict[str, Any],
                                                                     list[list[int]]]:
    """The same prompts through HF `generate` in static batches of `batch_size` (after a
    one-prompt warm-up); returns (figures as `run_engine_images`' without the encoder
    entries, output token ids per prompt)."""
    import torch
    import transformers

    from pagedllm.benchmarks.hf_baseline import pad_token_id
    from pagedllm.benchmarks.report import PeakRSSMonitor
    from pagedllm.benchmarks.throughput import throughput_figures
    from pagedllm.benchmarks.workload import BenchRequest
    from pagedllm.platforms import current_platform

    config = json.loads((Path(model_path) / "config.json").read_text())
    hf_class = next(a for a in config["architectures"] if a in _FAMILIES)
    device = current_platform.device

    def generate(batch_texts, batch_images, new_tokens):
        inputs = hf_image_inputs(family, model_path, batch_texts, batch_images)
        width = inputs["input_ids"].shape[1]
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=pad_id)
        mask = inputs["attention_mask"].sum(dim=1).tolist()
        return out[:, width:].tolist(), mask

    with PeakRSSMonitor() as mem, torch.inference_mode():
        model = getattr(transformers, hf_class).from_pretrained(model_path, dtype=dtype)
        model = model.to(device).eval()
        pad_id = pad_token_id(model)
        generate(texts[:1], images[:1], 2)
        tokens: list[list[int]] = []
        prompt_lens: list[int] = []
        start = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            out, lens = generate(texts[i:i + batch_size], images[i:i + batch_size], output_len)
            tokens += out
            prompt_lens += lens
        elapsed = time.perf_counter() - start
    requests = [BenchRequest([0] * n, output_len) for n in prompt_lens]
    figures = throughput_figures("hf", requests, tokens, elapsed, mem.peak_bytes)
    figures.update(batch_size=batch_size, dtype=str(dtype).removeprefix("torch."))
    del model
    return figures, tokens


def run_images_command(args: argparse.Namespace) -> int:
    """Build or find the model, run the engine (and HF with `--compare hf`), print the figures
    and save them; returns the exit status.

    Raises:
        ValueError: an unknown preset, a bad --image-size / --num-prompts / --output-len /
            --hf-batch-size, or a model outside the supported vision-language architectures.
    """
    import torch

    from pagedllm import LLM
    from pagedllm.benchmarks.cli import _finish, _run_dtype_name, dtype_name
    from pagedllm.benchmarks.report import print_result
    from pagedllm.benchmarks.throughput import compare
    from pagedllm.engine.arg_utils import engine_kwargs_from_args
    from pagedllm.platforms import current_platform

    if args.num_prompts < 1 or args.output_len < 1 or (
            args.hf_batch_size is not None and args.hf_batch_size < 1):
        raise ValueError("--num-prompts, --output-len and --hf-batch-size must be >= 1")
    image_size = parse_image_size(args.image_size) if args.image_size else None
    if args.preset:
        from pagedllm.benchmarks.vlm_presets import VLM_PRESETS, vlm_preset_path

        path = vlm_preset_path(args.preset, args.preset_dir)
        image_size = image_size or VLM_PRESETS[args.preset].image_size
        args = argparse.Namespace(**{**vars(args), "model": path})
    kwargs = engine_kwargs_from_args(args)
    kwargs["dtype"] = dtype_name(kwargs["dtype"])
    family = model_family(kwargs["model"])
    texts, images = image_workload(family, args.num_prompts, image_size or (256, 192),
                                   args.seed)
    llm = LLM(**kwargs)
    # The engine's planned thread count: its governor may lower torch's count under load and
    # leave it so; HF runs with the planned count.
    threads = torch.get_num_threads()
    ours, ours_tokens = run_engine_images(llm, texts, images, args.output_len, args.seed)
    ours.update(model=kwargs["model"], dtype=_run_dtype_name(kwargs["dtype"]),
                image_size=list(images[0].size))
    print_result(ours, "pagedllm, image prompts")
    del llm
    gc.collect()
    results = [ours]
    if "hf" in args.compare:
        dtype = current_platform.resolve_dtype(kwargs["dtype"])
        torch.set_num_threads(threads)
        theirs, hf_tokens = run_hf_images(family, kwargs["model"], texts, images,
                                          args.output_len,
                                          args.hf_batch_size or len(texts), dtype)
        theirs["torch_threads"] = threads
        print_result(theirs, "hf generate, image prompts")
        theirs["comparison"] = compare(ours, theirs, ours_tokens, hf_tokens)
        print_result(theirs["comparison"], "pagedllm / hf")
        results.append(theirs)
    return _finish(args, results)
