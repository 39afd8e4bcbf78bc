"""Per-half CPU time in a batch-32 run with the native stack detached (halves called one by one).
usage: prof2.py [rounds]  -- alternates MAX_TOKENS 256 (prefill on modules) and 1<<30 (native)."""
import collections, os, random, sys, time
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
from pagedllm.native import gdn_decoder as G
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["module", "native"]
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(32)]
llm = LLM(model=preset_path("qwen3-next-200m", "float32"), dtype="float32", seed=0)
sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, logprobs=0)
model = llm.llm_engine.engine_core.executor.worker.model_runner.model
stack = model.layer_stack; model.layer_stack = None
T = collections.defaultdict(float); N = collections.Counter()
def phase(n): return "prefill" if n > 64 else "decode"
for i, layer in enumerate(model._layer_list()):
    kind = "GA" if layer.is_attention_layer else "GDN"
    nm = layer.native_mixer
    def wrapped(pos, hid, nm=nm, kind=kind):
        s = time.thread_time(); out = nm(pos, hid); e = time.thread_time() - s
        T[(phase(hid.shape[0]), kind + ("-native" if out is not None else "-declined"))] += e
        return out
    layer.native_mixer = wrapped
    def pre(m, args, kind=kind): m._t = time.thread_time()
    def post(m, args, out, kind=kind):
        T[(phase(args[1].shape[0]), "layer-" + kind)] += time.thread_time() - m._t
    layer.register_forward_pre_hook(pre); layer.register_forward_hook(post)
    def mpre(m, args): m._t = time.thread_time()
    def mpost(m, args, out): T[(phase(args[0].shape[0]), "mlp")] += time.thread_time() - m._t
    layer.mlp.register_forward_pre_hook(mpre); layer.mlp.register_forward_hook(mpost)
llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
outs = {}
for r in range(rounds):
    for mode in modes:
        G.NativeGDNMixer.MAX_TOKENS = G.NativeGatedAttention.MAX_TOKENS = 256 if mode == "module" else 1 << 30
        T.clear()
        t = time.thread_time()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tot = time.thread_time() - t
        outs[mode] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in res]
        print(f"round {r} {mode}: total CPU {tot:.2f} s load {os.getloadavg()[0]:.1f}")
        for k, v in sorted(T.items()):
            print(f"   {k[0]:8s} {k[1]:18s} {v:7.3f} s")
if len(outs) == 2:
    a, b = outs["module"], outs["native"]
    eq = sum(x[0] == y[0] for x, y in zip(a, b))
    d = max(abs(p - q) for x, y in zip(a, b) if x[0] == y[0] for p, q in zip(x[1], y[1]))
    print(f"greedy equal {eq}/32, max |dlogprob| (equal rows) {d:.2e}")
