# 32 x (128 -> 128) greedy on deepseek-v2-lite-200m float32, after a warm-up; prints the
# thread CPU time and wall time of LLM.generate.  python run32.py [OUTPUT_LEN]
import os, random, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
OUT = int(sys.argv[1]) if len(sys.argv) > 1 else 128
llm = LLM(model=preset_path("deepseek-v2-lite-200m", "float32"), dtype="float32", max_model_len=512, seed=0)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
if os.environ.get("GO_FILE"): open(os.environ["GO_FILE"], "w").close()   # for attaching perf after the warm-up
t0 = time.thread_time(); w0 = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print(f"generate thread cpu {time.thread_time()-t0:.2f}s wall {time.perf_counter()-w0:.2f}s load {os.getloadavg()}")
