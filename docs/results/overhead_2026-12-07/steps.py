# Per-phase thread CPU of LLM.generate (32 x 128 -> OUT), 1 thread: engine step parts.
import collections, gc, os, random, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
DT = os.environ.get("DT", "float32"); P = sys.argv[1]; OUT = int(sys.argv[2])
llm = LLM(model=preset_path(P, DT), dtype=DT, max_model_len=512, seed=0)
rng = random.Random(int(os.environ.get("SEED", "0")))
prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]} for _ in range(32)]
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
eng = llm.llm_engine
core = eng.engine_core
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.thread_time()
        try: return f(*a, **k)
        finally: acc[label] += time.thread_time() - t; cnt[label] += 1
    setattr(obj, name, w)
print([n for n in dir(core) if not n.startswith("__")][:80])
sched = getattr(core, "scheduler", None) or core.engine_core.scheduler
wrap(sched, "schedule", "schedule"); wrap(sched, "update_from_output", "update_from_output")
ex = getattr(core, "executor", None) or core.engine_core.executor
runner = ex.worker.model_runner
wrap(runner, "execute_model", "execute_model"); wrap(runner, "sample_tokens", "sample_tokens")
wrap(eng.output_processor, "process_outputs", "process_outputs")
for n in ("sample_tokens_async","run_remaining_steps"):
    if hasattr(runner,n): wrap(runner,n,n)
if runner.multi_step.native_loop is not None: wrap(runner.multi_step.native_loop,"run","native_loop.run")
wrap(runner,"_forward","_forward")
wrap(runner.model,"compute_logits","compute_logits")

gcs = [0.0, 0]; st = [0.0]
def cb(phase, info):
    if phase == "start": st[0] = time.thread_time()
    else: gcs[0] += time.thread_time() - st[0]; gcs[1] += 1
gc.callbacks.append(cb)
t = time.thread_time(); w0 = time.perf_counter()
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True), use_tqdm=False)
tot = time.thread_time() - t
print(P, DT, OUT, "wall %.2f cpu %.2f" % (time.perf_counter() - w0, tot))
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]): print(f"  {k:22s} {v:7.3f} s  calls {cnt[k]}")
print("  gc %.3f s in %d collections; counts %s" % (gcs[0], gcs[1], gc.get_count()), gc.get_stats())
print("load", os.getloadavg())
