"""The vision encoder alone, ours against HF's, on the same images: `embed_multimodal` of our
model (as the engine loads it: packed linears, native layers attached) against HF's
`get_image_features` (tower + connector / merger), interleaved so both see the same load.

    PYTHONPATH=. python scripts/bench_vision_encoder.py [preset] [num_images] [reps] [--profile]

preset: `smolvlm-200m` (default) or `qwen2.5-vl-200m` (`pagedllm bench images`' presets, built
into the preset cache on first use); the images are the bench's (`draw_image`, seeds 0..n-1, at
the preset's size). Prints each repetition's wall and process CPU seconds (CPU seconds move less
with other processes' load on a shared machine), the median of each and the largest difference
between the two outputs. `--profile` runs one of our calls under torch.profiler
and prints its top ops by self CPU time.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def _rows(out, width: int) -> torch.Tensor:
    """HF's `get_image_features` result (a tensor, or an output with `pooler_output` a tensor
    or a list of per-image tensors) as one [rows, width] tensor."""
    out = getattr(out, "pooler_output", out)
    if isinstance(out, (list, tuple)):
        out = torch.cat([o.reshape(-1, width) for o in out])
    return out.reshape(-1, width)


def main() -> None:
    import transformers

    from pagedllm.benchmarks.images import hf_image_inputs
    from pagedllm.benchmarks.vlm_presets import VLM_PRESETS, draw_image, vlm_preset_path
    from pagedllm.model_loader.loader import load_model

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = args[0] if args else "smolvlm-200m"
    num_images = int(args[1]) if len(args) > 1 else 8
    reps = int(args[2]) if len(args) > 2 else 3
    preset = VLM_PRESETS[name]
    path = vlm_preset_path(name)
    images = [draw_image(*preset.image_size, seed) for seed in range(num_images)]
    texts = [f"Picture {i}: {preset.placeholder} describe it" for i in range(num_images)]
    inputs = hf_image_inputs(preset.family, path, texts, images)

    config = transformers.AutoConfig.from_pretrained(path)
    ours = load_model(path, config, torch.float32, torch.device("cpu"))
    hf = getattr(transformers, preset.hf_class).from_pretrained(path, dtype=torch.float32).eval()
    if preset.family == "idefics3":
        pixels = inputs["pixel_values"]                         # [B, tiles, 3, S, S]
        items = [{"pixel_values": p.numpy()} for p in pixels]

        def run_hf():
            return _rows(hf.model.get_image_features(pixels), config.text_config.hidden_size)
    else:
        grid = inputs["image_grid_thw"]
        sizes = (grid.prod(-1)).tolist()
        items = [{"pixel_values": p.numpy(), "image_grid_thw": g.numpy()}
                 for p, g in zip(inputs["pixel_values"].split(sizes), grid)]

        def run_hf():
            return _rows(hf.model.get_image_features(inputs["pixel_values"], grid),
                         config.text_config.hidden_size)

    def run_ours():
        return torch.cat(ours.embed_multimodal(items))

    print(f"{name}: {num_images} images, threads {torch.get_num_threads()}")
    with torch.inference_mode():
        a, b = run_ours(), run_hf()
        print(f"max |ours - hf| = {(a - b).abs().max().item():.3e} (|hf| max "
              f"{b.abs().max().item():.3e}), shape {tuple(a.shape)}")
        times = {"ours": [], "hf": []}
        cpu = {"ours": [], "hf": []}
        for _ in range(reps):
            for key, fn in (("ours", run_ours), ("hf", run_hf)):
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                times[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)
            print("  ".join(f"{k} {times[k][-1]:.2f} s (CPU {cpu[k][-1]:.2f} s)" for k in times),
                  flush=True)
        print("median: " + "  ".join(f"{k} {statistics.median(times[k]):.2f} s (CPU "
                                      f"{statistics.median(cpu[k]):.2f} s)" for k in times))
        if "--profile" in sys.argv:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run_ours()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
