"""Batch-32 profile: exclusive thread CPU time per module class, prefill vs decode forwards.
usage: prof.py engine|hf"""
import collections, os, random, sys, time
import torch
from pagedllm.benchmarks.presets import preset_path
which = sys.argv[1]
path = preset_path("qwen3-next-200m", "float32")
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(32)]
excl = {"prefill": collections.defaultdict(float), "decode": collections.defaultdict(float)}
calls = collections.Counter()
stack = []; phase = ["decode"]
def pre(m, args):
    stack.append([time.thread_time(), 0.0])
def post(m, args, out):
    s, ch = stack.pop(); e = time.thread_time() - s
    excl[phase[0]][type(m).__name__] += e - ch
    if stack: stack[-1][1] += e
def hook(model, top):
    def top_pre(m, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        if which == "hf":
            x = kwargs.get("input_ids", x)
            n = x.shape[-1]
        else:
            n = x.shape[0]
        phase[0] = "prefill" if n > 64 else "decode"; calls[phase[0]] += 1
    top.register_forward_pre_hook(top_pre, with_kwargs=True)
    for m in model.modules():
        m.register_forward_pre_hook(pre); m.register_forward_hook(post)
if which == "engine":
    from pagedllm import LLM, SamplingParams
    llm = LLM(model=path, dtype="float32", seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    t = time.thread_time(); llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    plain = time.thread_time() - t
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    hook(model, model.model if hasattr(model, "model") else model)
    # logits
    cl = model.compute_logits
    def timed(*a, **k):
        s = time.thread_time()
        try: return cl(*a, **k)
        finally: excl[phase[0]]["LM head"] += time.thread_time() - s
    model.compute_logits = timed
    t = time.thread_time(); llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    total = time.thread_time() - t
else:
    from pagedllm.benchmarks.hf_baseline import load_hf_model, hf_generate_batch
    model = load_hf_model(str(path), torch.float32)
    hf_generate_batch(model, [prompts[0][:16]], 4)
    t = time.thread_time(); hf_generate_batch(model, prompts, 128); plain = time.thread_time() - t
    hook(model, model.model)
    t = time.thread_time(); hf_generate_batch(model, prompts, 128); total = time.thread_time() - t
print(f"{which}: plain CPU {plain:.2f} s, hooked {total:.2f} s, calls {dict(calls)} threads {torch.get_num_threads()}")
for ph, d in excl.items():
    s = sum(d.values())
    print(f"-- {ph}: {s:.2f} s")
    for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:14]:
        print(f"   {k:36s} {v:7.3f} s")
print("load", os.getloadavg())
