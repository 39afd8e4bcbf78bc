"""The decode recurrence's memory floor on this host: an in-place scale (read + write) of 4 MiB
float32 arrays (one Gated DeltaNet layer's 32 states of 8 x 64 x 64), 9 of them in turn as a
decode step walks its layers; thread CPU per array."""
import time, torch
torch.set_num_threads(1)
arrs = [torch.randn(32 * 8 * 4096) for _ in range(9)]
for rep in range(3):
    t = time.thread_time()
    for _ in range(20):
        for a in arrs:
            a.mul_(0.9999)
    dt = (time.thread_time() - t) / 180
    gbs = 2 * arrs[0].numel() * 4 / dt / 1e9
    print(f"in-place scale of 4 MiB: {dt * 1e3:.4f} ms, {gbs:.1f} GB/s")
