# The routed experts of a 32-row DeepSeek-200M step (ops.cpu_fused_moe) against one read of all
# their weights (torch sum over 88 MB), and a 1-row step; CPU ms per call, one thread.
import os, time, torch, ctypes, sys
torch.set_num_threads(1)
from pagedllm.native.kernels import ops, cpu_kernels, abi
from pagedllm.layers.fused_moe import select_experts
E, H, I = 64, 512, 224
gen = torch.Generator().manual_seed(0)
w13 = torch.randn(E, 2 * I, H, generator=gen) / 22; w2 = torch.randn(E, H, I, generator=gen) / 15
x = torch.randn(32, H, generator=gen)
w, ids = select_experts(torch.randn(32, E, generator=gen), 6, renormalize=True)
big = torch.cat([w13.flatten(), w2.flatten()])
def tm(f, n=30):
    f(); t = time.thread_time()
    for _ in range(n): f()
    return (time.thread_time() - t) / n * 1e3
for r in range(3):
    print(f"sum-read {tm(lambda: big.sum()):.2f} ms  fused_moe {tm(lambda: ops.cpu_fused_moe(x, w13, w2, w, ids)):.2f} ms  "
          f"1-row fused {tm(lambda: ops.cpu_fused_moe(x[:1], w13, w2, w[:1], ids[:1])):.2f}  load {os.getloadavg()[0]:.1f}")
