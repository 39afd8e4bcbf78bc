# batch-32 profile: exclusive thread CPU time per module class, prefill and decode apart.
import collections, os, random, sys, time
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
OUT = int(sys.argv[1]) if len(sys.argv) > 1 else 64
llm = LLM(model=preset_path("deepseek-v2-lite-200m", "float32"), dtype="float32", max_model_len=512, seed=0)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
model = llm.llm_engine.engine_core.executor.worker.model_runner.model
ex = {"prefill": collections.defaultdict(float), "decode": collections.defaultdict(float)}
calls = {"prefill": collections.Counter(), "decode": collections.Counter()}
stack = []
phase = ["decode"]
def pre(m, args):
    if not stack and args and isinstance(args[0], torch.Tensor):
        phase[0] = "prefill" if args[0].numel() > 64 else "decode"
    stack.append([time.thread_time(), 0.0])
def post(m, args, out):
    s, ch = stack.pop(); el = time.thread_time() - s
    ex[phase[0]][type(m).__name__] += el - ch; calls[phase[0]][type(m).__name__] += 1
    if stack: stack[-1][1] += el
hs = [m.register_forward_pre_hook(pre) for m in model.modules()] + [m.register_forward_hook(post) for m in model.modules()]
cl = model.compute_logits
def tl(*a, **k):
    s = time.thread_time()
    try: return cl(*a, **k)
    finally: ex[phase[0]]["LM head"] += time.thread_time() - s; calls[phase[0]]["LM head"] += 1
model.compute_logits = tl
t0 = time.thread_time(); w0 = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
tot = time.thread_time() - t0
print(f"total thread cpu {tot:.2f}s wall {time.perf_counter()-w0:.2f}s")
for ph in ex:
    s = sum(ex[ph].values())
    print(f"-- {ph}: {s:.2f}s")
    for n, t in sorted(ex[ph].items(), key=lambda kv: -kv[1])[:14]:
        print(f"   {n:36s} {t*1e3:9.1f} ms  calls {calls[ph][n]}")
print("rest", tot - sum(sum(v.values()) for v in ex.values()))
print("load", os.getloadavg())
