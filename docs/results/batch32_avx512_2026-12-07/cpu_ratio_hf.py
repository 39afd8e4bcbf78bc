# pagedllm vs HF transformers on 32 x (128 -> 128) greedy, deepseek-v2-lite-200m float32, one
# thread: thread CPU time of each generate (after a warm-up), alternated ROUNDS times in one
# process, so that a loaded host's descheduling does not enter the ratio (its cache and memory
# contention still does).  OMP_NUM_THREADS=1 PAGEDLLM_CPU_THREADS=1 python cpu_ratio_hf.py [ROUNDS]
import os, random, sys, time
import torch
torch.set_num_threads(1)
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.hf_baseline import hf_generate_batch, load_hf_model
from pagedllm.benchmarks.presets import preset_path
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
path = preset_path("deepseek-v2-lite-200m", "float32")
llm = LLM(model=path, dtype="float32", max_model_len=512, seed=0)
hf = load_hf_model(str(path), torch.float32)
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(32)]
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
hf_generate_batch(hf, prompts[:1], 4)
for r in range(rounds):
    t = time.thread_time(); w = time.perf_counter()
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    cpu_p, wall_p = time.thread_time() - t, time.perf_counter() - w
    t = time.thread_time(); w = time.perf_counter()
    theirs = hf_generate_batch(hf, prompts, 128)
    cpu_h, wall_h = time.thread_time() - t, time.perf_counter() - w
    same = sum(list(o.outputs[0].token_ids) == h for o, h in zip(ours, theirs))
    print(f"round {r + 1}: pagedllm cpu {cpu_p:.2f}s (wall {wall_p:.1f}s)  hf cpu {cpu_h:.2f}s "
          f"(wall {wall_h:.1f}s)  cpu ratio hf/pagedllm {cpu_h / cpu_p:.2f}x  greedy equal {same}/32  "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
