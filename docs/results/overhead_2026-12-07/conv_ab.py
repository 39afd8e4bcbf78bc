# A/B of the conv's decode step (32 one-token requests, 1024 channels, width 4: Qwen3-Next
# 200M's Gated DeltaNet conv), libraries alternated, thread CPU per 9 layer calls.
import ctypes, os, sys, time
import numpy as np, torch
from pagedllm.native.kernels.state_scan import StateBatchArgs
torch.set_num_threads(1)
libs = [ctypes.CDLL(p) for p in sys.argv[1:]]
DT = getattr(torch, os.environ.get("DT", "float32"))
R, C, K, L = 32, 1024, 4, 9
g = torch.Generator().manual_seed(0)
x = [torch.randn(R, C, generator=g).to(DT) for _ in range(L)]
w = torch.randn(C, K, generator=g); b = None
states0 = [torch.randn(64, C, K - 1, generator=g).to(DT) for _ in range(L)]
batch = StateBatchArgs(torch.arange(R + 1), torch.randperm(64, generator=g)[:R], torch.ones(R, dtype=torch.bool), 64)
codes = {torch.float32: 0, torch.bfloat16: 1}
def run(lib, states, outs):
    for l in range(L):
        rc = lib.causal_conv1d_varlen_cpu(ctypes.c_void_p(batch.ptr), ctypes.c_void_p(x[l].data_ptr()), ctypes.c_int64(C), ctypes.c_int64(C), ctypes.c_int64(K),
            ctypes.c_void_p(w.data_ptr()), None, ctypes.c_void_p(states[l].data_ptr()), ctypes.c_int(codes[DT]), ctypes.c_int(1), ctypes.c_void_p(outs[l].data_ptr()), ctypes.c_int(codes[DT]))
        assert rc == 0
res = []
for lib in libs:
    st = [s.clone() for s in states0]; outs = [torch.empty(R, C, dtype=DT) for _ in range(L)]
    run(lib, st, outs); res.append((st, outs))
for st, outs in res[1:]:
    print("bit-identical:", all(torch.equal(a, b) for a, b in zip(st + outs, res[0][0] + res[0][1])))
tot = [[] for _ in libs]
for it in range(40):
    for i, lib in enumerate(libs):
        st = res[i][0]; outs = res[i][1]
        t = time.thread_time()
        for _ in range(5): run(lib, st, outs)
        tot[i].append((time.thread_time() - t) / 5 * 1e3)
for p, t in zip(sys.argv[1:], tot): print(f"{p}: median {np.median(t):.3f} ms per 9 layers, min {np.min(t):.3f}")
print("load", os.getloadavg())
