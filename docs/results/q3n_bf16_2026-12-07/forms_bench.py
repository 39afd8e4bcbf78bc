# The three ways the packed GEMM multiplies (bf16 pair panels read by the widening form or by
# vdpbf16ps, float32 panels) through pagedllm.native.kernels.ops, one process, best of REPS calls
# per round, best of 3 rounds; one thread: OMP_NUM_THREADS=1 python forms_bench.py
import sys, time, torch
from pagedllm.native.kernels import ops
torch.manual_seed(0)
shapes = [(32, 32000, 768), (32, 1552, 768), (32, 768, 512), (32, 1024, 768), (32, 768, 256),(1365,1552,768),(1365,1024,768),(1365, 768, 512)]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
ws = {}
for (m, n, k) in shapes:
    w = torch.randn(n, k) * 0.05
    ws[(m,n,k)] = (ops.pack_linear_weight(w), ops.pack_linear_weight(w.bfloat16()), torch.randn(m, k))
def t(fn, reps):
    best = 1e9
    for _ in range(reps):
        c = time.thread_time(); fn(); best = min(best, time.thread_time() - c)
    return best
for (m, n, k), (wf, wb, x) in ws.items():
    reps = 20 if m == 32 else 3
    res = {}
    for r in range(rounds):
        for form in ("widen", "dot"):
            ops.set_packed_pairs_form(form)
            res.setdefault(form, []).append(t(lambda: ops.packed_linear(x, wb), reps))
        res.setdefault("f32", []).append(t(lambda: ops.packed_linear(x, wf), reps))
    print(f"{m}x{n}x{k}: " + "  ".join(f"{f} {min(v)*1e3:.3f} ms {m*n*k/min(v)/1e9:.1f} GMAC/s" for f, v in res.items()), flush=True)
