# Usage: OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 PYTHONPATH=<tree> python phases.py PRESET DTYPE [REPS]
"""Engine phases on the bench's image prompts: encoder, prefill (max_tokens=1) and 32 tokens."""
import sys, time
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.images import image_workload, model_family
from pagedllm.benchmarks.vlm_presets import VLM_PRESETS, vlm_preset_path
name, dtype = sys.argv[1], sys.argv[2]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
path = vlm_preset_path(name)
llm = LLM(model=path, dtype=dtype, kv_cache_memory_bytes=268435456, enable_prefix_caching=False)
fam = model_family(path)
def run(n_out, seed):
    texts, images = image_workload(fam, 8, VLM_PRESETS[name].image_size, seed)
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
    b = llm.collective_rpc("encoder_stats")[0]["encoder_time_s"]
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True), use_tqdm=False)
    w, c = time.perf_counter() - t0, time.process_time() - c0
    e = llm.collective_rpc("encoder_stats")[0]["encoder_time_s"] - b
    return w, c, e
run(2, 100)
for r in range(reps):
    for n in (1, 32):
        w, c, e = run(n, 10 * r + n)
        print(f"{name} {dtype} max_tokens={n}: wall {w:.2f} s, cpu {c:.2f} s, encoder {e:.2f} s, rest {w - e:.2f} s", flush=True)
