# Usage: OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 PYTHONPATH=<tree> python tower_ab.py PRESET [REPS] [--prof]
"""Our tower in bf16 and fp32 in one process, alternated; per-module wall via hooks."""
import sys, time, collections
import torch
from pagedllm.benchmarks.images import hf_image_inputs
from pagedllm.benchmarks.vlm_presets import VLM_PRESETS, draw_image, vlm_preset_path
from pagedllm.model_loader.loader import load_model
import transformers

name = sys.argv[1]; reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
preset = VLM_PRESETS[name]; path = vlm_preset_path(name)
images = [draw_image(*preset.image_size, s) for s in range(8)]
texts = [f"Picture {i}: {preset.placeholder} describe it" for i in range(8)]
inputs = hf_image_inputs(preset.family, path, texts, images)
config = transformers.AutoConfig.from_pretrained(path)
models = {dt: load_model(path, config, getattr(torch, dt), torch.device("cpu")) for dt in ("bfloat16", "float32")}
hfm = {dt: getattr(transformers, preset.hf_class).from_pretrained(path, dtype=getattr(torch, dt)).eval() for dt in ("bfloat16", "float32")}
if preset.family == "idefics3":
    items = [{"pixel_values": p.numpy()} for p in inputs["pixel_values"]]
else:
    grid = inputs["image_grid_thw"]; sizes = grid.prod(-1).tolist()
    items = [{"pixel_values": p.numpy(), "image_grid_thw": g.numpy()} for p, g in zip(inputs["pixel_values"].split(sizes), grid)]
acc = {dt: collections.defaultdict(float) for dt in models}
LIN = ("ColumnParallelLinear", "RowParallelLinear", "QKVParallelLinear", "MergedColumnParallelLinear", "Linear", "Conv2d")
for dt, model in models.items():
    for n, m in model.named_modules():
        cls = type(m).__name__
        if cls in LIN or cls in ("LayerNorm", "RMSNorm"):
            key = ("linear" if cls in LIN else "norm")
            def pre(mod, a): mod._t0 = time.perf_counter()
            def post(mod, a, o, key=key, dt=dt): acc[dt][key] += time.perf_counter() - mod._t0
            m.register_forward_pre_hook(pre); m.register_forward_hook(post)
tot = collections.defaultdict(list)
def hf_run(dt):
    m = hfm[dt]
    if preset.family == "idefics3":
        return m.model.get_image_features(inputs["pixel_values"].to(getattr(torch, dt)))
    return m.model.get_image_features(inputs["pixel_values"].to(getattr(torch, dt)), inputs["image_grid_thw"])
with torch.inference_mode():
    for dt in models: models[dt].embed_multimodal(items)
    for dt in models: acc[dt].clear()
    for r in range(reps):
        for dt, model in models.items():
            t0 = time.perf_counter(); c0 = time.process_time()
            model.embed_multimodal(items)
            tot[dt].append((time.perf_counter() - t0, time.process_time() - c0))
            t0 = time.perf_counter(); c0 = time.process_time()
            hf_run(dt)
            tot["hf-" + dt].append((time.perf_counter() - t0, time.process_time() - c0))
print(name, "threads", torch.get_num_threads())
for dt in tot:
    if dt.startswith("hf-"):
        print(f"  {dt}: wall/cpu " + " ".join(f"{a:.2f}/{b:.2f}" for a, b in tot[dt])); continue
    w = sum(b for a, b in tot[dt]) / reps
    print(f"  {dt}: wall/cpu " + " ".join(f"{a:.2f}/{b:.2f}" for a, b in tot[dt]) +
          f"  mean wall {w:.2f}: linear {acc[dt]['linear']/reps:.2f} norm {acc[dt]['norm']/reps:.2f} rest {w - (acc[dt]['linear'] + acc[dt]['norm'])/reps:.2f}")
if "--prof" in sys.argv:
    from torch.profiler import profile
    for dt in models:
        with torch.inference_mode(), profile() as p: models[dt].embed_multimodal(items)
        print(dt); print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
