# In-process A/B of two builds of the kernel library (same ABI, same Python code): one engine,
# every object holding the library (`_lib`) and the library module's handle switched between
# the builds before each LLM.generate of 32 x (128 -> OUT) greedy, 1 thread, prefix caching
# off; thread CPU per generate and of the native decode loop, tokens compared across builds.
import ctypes, os, sys, time
import numpy as np
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
from pagedllm.native.kernels import abi, library
P, DT, OUT, ROUNDS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
paths = sys.argv[5:]
llm = LLM(model=preset_path(P, DT), dtype=DT, max_model_len=512, seed=0, enable_prefix_caching=False)
libs = []
for p in paths:
    lib = ctypes.CDLL(p); abi.declare(lib); libs.append(lib)
runner = llm.llm_engine.engine_core.executor.worker.model_runner
holders, seen, todo = [], set(), [runner.model]
while todo:   # every object reachable from the model (attributes, containers) with a `_lib`
    o = todo.pop()
    if id(o) in seen or isinstance(o, (str, bytes, int, float, np.ndarray)) or type(o).__module__.startswith(("torch", "ctypes")):
        continue
    seen.add(id(o))
    if isinstance(o, ctypes.CDLL):
        continue
    if isinstance(getattr(o, "__dict__", None), dict):
        if isinstance(o.__dict__.get("_lib"), ctypes.CDLL): holders.append(o)
        todo.extend(o.__dict__.values())
    if isinstance(o, (list, tuple, set)): todo.extend(o)
    if isinstance(o, dict): todo.extend(o.values())
    if hasattr(o, "_modules") and isinstance(o._modules, dict): todo.extend(o._modules.values())
print("holders:", sorted({type(h).__name__ for h in holders}), len(holders), flush=True)
def use(lib):
    library._library = lib
    for h in holders: h._lib = lib
loop_cpu = [0.0]
nl = runner.multi_step.native_loop
if nl is not None:
    f = nl.run
    def timed(*a, **k):
        t0 = time.thread_time()
        try: return f(*a, **k)
        finally: loop_cpu[0] += time.thread_time() - t0
    nl.run = timed
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(100, 30000, 128).tolist()} for _ in range(32)]
sp = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
for lib in libs:
    use(lib); llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
res = {i: [] for i in range(len(libs))}
toks = {}
for r in range(ROUNDS):
    order = range(len(libs)) if r % 2 == 0 else reversed(range(len(libs)))
    for i in order:
        use(libs[i]); loop_cpu[0] = 0.0
        t = time.thread_time(); w = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        cpu, wall = time.thread_time() - t, time.perf_counter() - w
        res[i].append((cpu, loop_cpu[0]))
        toks.setdefault(i, [o.outputs[0].token_ids for o in outs])
        print(f"round {r} {os.path.basename(os.path.dirname(paths[i]))}: cpu {cpu:.2f} s wall {wall:.2f} s native loop {loop_cpu[0]:.2f} s load {os.getloadavg()[0]:.2f}", flush=True)
for i in res:
    c = np.array(res[i])
    print(f"{P} {DT} {paths[i]}: median generate cpu {np.median(c[:,0]):.2f} s, native loop {np.median(c[:,1]):.2f} s, tok/s(cpu) {32*OUT/np.median(c[:,0]):.1f}")
print("tokens equal across builds:", all(toks[i] == toks[0] for i in toks))
