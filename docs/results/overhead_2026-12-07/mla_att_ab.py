# A/B of MLA-shaped decode attention (8 query heads on one shared 144-value latent "KV head",
# the key cache = the value cache), 32 requests of ~192 positions, 8 layers' caches, 1 thread;
# libraries given on the command line, alternated; thread CPU per "step" (8 layer calls).
import ctypes, os, sys, time
import numpy as np, torch
from pagedllm.native.kernels import attention_ops as ops
torch.set_num_threads(1)
libs = [ctypes.CDLL(p) for p in sys.argv[1:]]
H, D, BS, R, L = int(os.environ.get("H", "8")), int(os.environ.get("D", "144")), 16, 32, int(os.environ.get("LAYERS", "8"))
CTX = int(os.environ.get("CTX", "192")); KVH = int(os.environ.get("KVH", "1"))
DT = getattr(torch, os.environ.get("DT", "float32"))
g = torch.Generator().manual_seed(0)
nb_per = (CTX + BS - 1) // BS
num_blocks = R * nb_per * 3
caches, tables = [], []
for _ in range(L):
    base = torch.randn(num_blocks, BS, KVH, D, generator=g).to(DT)
    caches.append(base.unsqueeze(0).expand(2, *base.shape) if KVH == 1 else
                  torch.randn(2, num_blocks, BS, KVH, D, generator=g).to(DT))
    perm = torch.randperm(num_blocks, generator=g)[:R * nb_per].to(torch.int32)
    tables.append(perm.view(R, nb_per).contiguous())
q = torch.randn(R, H, D, generator=g)
qsl = np.arange(R + 1, dtype=np.int32); seq = np.full(R, CTX, dtype=np.int32)
seq -= np.arange(R, dtype=np.int32) % 16
rows = np.arange(R, dtype=np.int32)
outs = [torch.zeros(R, H, D) for _ in libs]
def step(lib, out):
    for l in range(L):
        ops.paged_attention(q, caches[l], tables[l], qsl, seq, rows, 0.1, lib=lib, out=out,
                            checked=False)
for lib, out in zip(libs, outs): step(lib, out)
for o in outs[1:]: print("bit-identical:", torch.equal(o, outs[0]))
tot = [[] for _ in libs]
for it in range(int(os.environ.get("ITERS", "40"))):
    for i, lib in enumerate(libs):
        t = time.thread_time()
        for _ in range(5): step(lib, outs[i])
        tot[i].append((time.thread_time() - t) / 5 * 1e3)
for p, t in zip(sys.argv[1:], tot):
    print(f"{p}: median {np.median(t):.3f} ms/step  min {np.min(t):.3f}")
print("load", os.getloadavg())
