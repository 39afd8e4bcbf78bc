# The lead's whole-run timer (/tmp/s23/run32.py) plus a hash of the generated tokens.
import hashlib, os, random, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
DT = os.environ.get("DT", "float32"); P = sys.argv[1]; OUT = int(sys.argv[2])
llm = LLM(model=preset_path(P, DT), dtype=DT, max_model_len=512, seed=0)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
t = time.perf_counter(); c = time.thread_time()
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True), use_tqdm=False)
wall, cpu = time.perf_counter() - t, time.thread_time() - c
h = hashlib.sha1(str([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:10]
print(f"{os.environ.get('TAG','?')} {P} {DT} wall {wall:.2f} cpu {cpu:.2f} tokens {h} load {os.getloadavg()[0]:.1f}", flush=True)
