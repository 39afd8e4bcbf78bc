# Usage: OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 PYTHONPATH=<tree> python prefill_prof.py PRESET DTYPE MAX_TOKENS
import sys, time, torch
from torch.profiler import profile
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.images import image_workload, model_family
from pagedllm.benchmarks.vlm_presets import VLM_PRESETS, vlm_preset_path
name, dtype, n_out = sys.argv[1], sys.argv[2], int(sys.argv[3])
path = vlm_preset_path(name)
llm = LLM(model=path, dtype=dtype, kv_cache_memory_bytes=268435456, enable_prefix_caching=False)
fam = model_family(path)
def prompts(seed):
    texts, images = image_workload(fam, 8, VLM_PRESETS[name].image_size, seed)
    return [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in zip(texts, images)]
sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
llm.generate(prompts(100), sp, use_tqdm=False)
p_ = prompts(5)
with profile() as p:
    t0 = time.thread_time(); llm.generate(p_, sp, use_tqdm=False); print("thread cpu", time.thread_time() - t0)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
