# The LM head of the 200M presets (32000 x 512, float32) at 32 and 1 rows: the packed GEMM
# (packed_gemm.h) against torch (MKL); CPU ms per call, one thread.
import time, torch, os
torch.set_num_threads(1)
from pagedllm.native.kernels import ops
W = torch.randn(32000, 512) / 22
P = ops.pack_linear_weight(W.clone())
for M in (32, 1):
    x = torch.randn(M, 512)
    ref = x @ W.T
    got = ops.packed_linear(x, P)
    print("maxerr", (got - ref).abs().max().item())
    for rnd in range(3):
        for name, f in (("packed", lambda: ops.packed_linear(x, P)), ("mkl", lambda: x @ W.T)):
            f(); t = time.thread_time(); n = 20
            for _ in range(n): f()
            print(M, name, f"{(time.thread_time()-t)/n*1e3:.2f} ms")
print(os.getloadavg())
