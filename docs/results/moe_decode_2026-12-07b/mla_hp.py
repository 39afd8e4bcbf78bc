"""MLA-shaped decode attention (8 query heads on one shared 144-value latent row per position,
key cache = value cache, DeepSeek-V2-Lite 200M float32), 32 requests of ~192 positions, 8
layers' caches of 4096 blocks x 16 (as the engine's), block tables drawn at random: the caches
on torch's 4 KiB pages against the same caches on 2 MiB pages (`huge_page_empty`), alternated
in one process, thread CPU ms per step (8 layer calls), one thread.
usage: OMP_NUM_THREADS=1 python mla_hp.py [ITERS]"""
import os, sys, time
import numpy as np, torch
from pagedllm.huge_pages import huge_page_empty
from pagedllm.native.kernels import attention_ops as ops
torch.set_num_threads(1)
H, D, BS, R, L, CTX, NUM_BLOCKS = 8, 144, 16, 32, 8, 192, 4096
g = torch.Generator().manual_seed(0)
nb_per = (CTX + BS - 1) // BS
sets = {"4K": [], "2M": []}
tables = []
for _ in range(L):
    base = torch.randn(NUM_BLOCKS, BS, 1, D, generator=g)
    huge = huge_page_empty(tuple(base.shape), base.dtype)
    huge.copy_(base)
    for name, t in (("4K", base), ("2M", huge)):
        sets[name].append(t.unsqueeze(0).expand(2, *t.shape))
    perm = torch.randperm(NUM_BLOCKS, generator=g)[:R * nb_per].to(torch.int32)
    tables.append(perm.view(R, nb_per).contiguous())
q = torch.randn(R, H, D, generator=g)
qsl = np.arange(R + 1, dtype=np.int32)
seq = np.full(R, CTX, dtype=np.int32) - np.arange(R, dtype=np.int32) % 16
rows = np.arange(R, dtype=np.int32)
outs = {name: torch.zeros(R, H, D) for name in sets}


def step(name):
    for l in range(L):
        ops.paged_attention(q, sets[name][l], tables[l], qsl, seq, rows, 0.1, out=outs[name],
                            checked=False)


for name in sets:
    step(name)
print("bit-identical:", torch.equal(outs["4K"], outs["2M"]))
tot = {name: [] for name in sets}
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
    for name in (("4K", "2M") if it % 2 == 0 else ("2M", "4K")):
        t = time.thread_time()
        for _ in range(5):
            step(name)
        tot[name].append((time.thread_time() - t) / 5 * 1e3)
ratio = np.median(np.array(tot["2M"]) / np.array(tot["4K"]))
print(" ".join(f"{n}: median {np.median(t):.3f} ms/step" for n, t in tot.items()),
      f" 2M/4K median {ratio:.3f}  load {os.getloadavg()[0]:.1f}")
