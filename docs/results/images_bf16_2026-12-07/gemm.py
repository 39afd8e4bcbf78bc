# Usage: OMP_NUM_THREADS=1 PYTHONPATH=<tree> python gemm.py [M]: packed fp32 / bf16 widen / bf16 dot / torch fp32 / torch bf16, GMAC/s
import sys, time, torch
from pagedllm.native.kernels import ops
torch.manual_seed(0)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
shapes = [(4096, 768), (768, 2048), (2304, 768), (3072, 768), (768, 3072)]
def bench(fn, reps=3):
    best = 1e9
    for _ in range(reps):
        t0 = time.thread_time(); fn(); best = min(best, time.thread_time() - t0)
    return best
print("threads", torch.get_num_threads(), "pairs form", ops.packed_pairs_form())
for n, k in shapes:
    w = torch.randn(n, k) * 0.05
    x = torch.randn(M, k)
    pf = ops.pack_linear_weight(w); pb = ops.pack_linear_weight(w.bfloat16())
    xb = x.bfloat16()
    res = {}
    for r in range(2):
        res.setdefault("f32", []).append(bench(lambda: ops.packed_linear(x, pf)))
        ops.set_packed_pairs_form("widen")
        res.setdefault("bf16 widen", []).append(bench(lambda: ops.packed_linear(xb, pb)))
        ops.set_packed_pairs_form("dot")
        res.setdefault("bf16 dot", []).append(bench(lambda: ops.packed_linear(xb, pb)))
        res.setdefault("torch f32", []).append(bench(lambda: torch.nn.functional.linear(x, w)))
        wb = w.bfloat16()
        res.setdefault("torch bf16", []).append(bench(lambda: torch.nn.functional.linear(xb, wb)))
    macs = M * n * k
    print(f"{M}x{n}x{k}: " + "  ".join(f"{key} {min(v)*1e3:.1f}ms {macs/min(v)/1e9:.0f}GMAC/s" for key, v in res.items()))
