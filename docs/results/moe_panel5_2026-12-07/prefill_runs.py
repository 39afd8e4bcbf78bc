"""The prefill alone, several samples per process: RUNS x LLM.generate of 32 fresh random
prompts x (128 -> 1) greedy (new prompt ids each run, so no run hits the prefix cache), one
thread; prints wall and thread CPU seconds of each and the median CPU.
usage: DT=float32|bfloat16 python prefill_runs.py PRESET [RUNS]"""
import os
import random
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path

DT = os.environ.get("DT", "float32")
P = sys.argv[1]
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
llm = LLM(model=preset_path(P, DT), dtype=DT, max_model_len=512, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
rng = random.Random(0)
fresh = lambda n: [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]}
                   for _ in range(n)]
llm.generate(fresh(2), params, use_tqdm=False)
cpus = []
for _ in range(RUNS):
    prompts = fresh(32)
    t, c = time.perf_counter(), time.thread_time()
    llm.generate(prompts, params, use_tqdm=False)
    cpus.append(time.thread_time() - c)
    print(P, DT, "wall %.2f cpu %.2f" % (time.perf_counter() - t, cpus[-1]), flush=True)
print(P, DT, "median cpu %.2f min %.2f" % (statistics.median(cpus), min(cpus)), flush=True)
