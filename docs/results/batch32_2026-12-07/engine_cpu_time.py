"""CPU time of LLM.generate on 32 x (128 -> 128), qwen3-next-200m float32, one thread; prints
per-run CPU / wall and writes the greedy tokens to argv[1]."""
import json, os, random, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(32)]
llm = LLM(model=preset_path("qwen3-next-200m", "float32"), dtype="float32", seed=0)
sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
for r in range(int(os.environ.get("ROUNDS", "2"))):
    t, w = time.thread_time(), time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    cpu, wall = time.thread_time() - t, time.perf_counter() - w
    print(f"{os.environ['PYTHONPATH']}: cpu {cpu:.2f} s wall {wall:.2f} s tok/s(cpu) {4096/cpu:.1f} load {os.getloadavg()[0]:.2f}", flush=True)
json.dump([o.outputs[0].token_ids for o in out], open(sys.argv[1], "w"))
