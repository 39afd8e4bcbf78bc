"""32 x (128 -> 128) greedy with random prompt ids: prints wall and thread CPU seconds of each
LLM.generate. usage: DT=float32|bfloat16 python run32.py PRESET OUTPUT_LEN [RUNS] (later runs hit
the prefix cache for the prompts)."""
import random, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
import os; DT = os.environ.get("DT", "float32"); P = sys.argv[1]; OUT = int(sys.argv[2])
llm = LLM(model=preset_path(P, DT), dtype=DT, max_model_len=512, seed=0)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    t = time.perf_counter(); c = time.thread_time()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True), use_tqdm=False)
    print(P, OUT, "wall %.2f cpu %.2f" % (time.perf_counter() - t, time.thread_time() - c), flush=True)
