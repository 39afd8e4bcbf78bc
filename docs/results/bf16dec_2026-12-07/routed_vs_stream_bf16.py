# The routed experts of a 32-row DeepSeek-V2-Lite-200M step (ops.cpu_fused_moe) against one read
# of all their weights (a float32 sum over the same bytes: 88 MB float32, 44 MB bfloat16), and a
# 1-row step; CPU ms per call, one thread, both dtypes.
import os, time, torch
torch.set_num_threads(1)
from pagedllm.native.kernels import ops
from pagedllm.layers.fused_moe import select_experts
E, H, I = 64, 512, 224
gen = torch.Generator().manual_seed(0)
w13f = torch.randn(E, 2 * I, H, generator=gen) / 22; w2f = torch.randn(E, H, I, generator=gen) / 15
xf = torch.randn(32, H, generator=gen)
w, ids = select_experts(torch.randn(32, E, generator=gen), 6, renormalize=True)
def tm(f, n=30):
    f(); t = time.thread_time()
    for _ in range(n): f()
    return (time.thread_time() - t) / n * 1e3
for dt in (torch.float32, torch.bfloat16):
    w13, w2, x = w13f.to(dt), w2f.to(dt), xf.to(dt)
    big = torch.cat([w13.flatten(), w2.flatten()]).view(torch.float32)
    for r in range(3):
        print(f"{dt}: read {big.numel()*4/1e6:.0f} MB {tm(lambda: big.sum()):.2f} ms  32-row fused_moe "
              f"{tm(lambda: ops.cpu_fused_moe(x, w13, w2, w, ids)):.2f} ms  1-row "
              f"{tm(lambda: ops.cpu_fused_moe(x[:1], w13, w2, w[:1], ids[:1])):.2f} ms  load {os.getloadavg()[0]:.1f}", flush=True)
