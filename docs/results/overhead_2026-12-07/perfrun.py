# Waits for the engine, then signals readiness so perf can attach only around generate.
import os, random, sys, time, signal
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
DT = os.environ.get("DT", "float32"); P = sys.argv[1]; OUT = int(sys.argv[2])
llm = LLM(model=preset_path(P, DT), dtype=DT, max_model_len=512, seed=0)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
open(sys.argv[3], "w").write(str(os.getpid())); time.sleep(2)
t = time.thread_time()
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True), use_tqdm=False)
print("cpu %.2f" % (time.thread_time() - t), flush=True)
