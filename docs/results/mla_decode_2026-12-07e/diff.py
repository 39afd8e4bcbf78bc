# Outputs of the two libraries (argv) on mla_att_ab.py's MLA decode shape (8 heads, one
# 144-value latent, 32 requests of 177-192 positions, one layer): max |main - branch| and each
# one's max error against float64 attention computed from the same cache.
import ctypes, sys
import numpy as np, torch
from pagedllm.native.kernels import attention_ops as ops
torch.set_num_threads(1)
H, D, BS, R, CTX = 8, 144, 16, 32, 192
g = torch.Generator().manual_seed(0)
nb = CTX // BS
for dt in (torch.float32, torch.bfloat16):
    base = torch.randn(R * nb * 3, BS, 1, D, generator=g).to(dt)
    cache = base.unsqueeze(0).expand(2, *base.shape)
    table = torch.randperm(R * nb * 3, generator=g)[:R * nb].to(torch.int32).view(R, nb).contiguous()
    q = torch.randn(R, H, D, generator=g)
    qsl = np.arange(R + 1, dtype=np.int32)
    seq = (np.full(R, CTX) - np.arange(R) % 16).astype(np.int32)
    outs = [ops.paged_attention(q, cache, table, qsl, seq, np.arange(R, dtype=np.int32), 0.1,
                                lib=ctypes.CDLL(p)) for p in sys.argv[1:3]]
    ref = torch.empty(R, H, D, dtype=torch.float64)
    for r in range(R):
        pos = np.arange(seq[r])
        rows = base[table[r].long()[pos // BS], torch.from_numpy(pos % BS), 0].double()
        p = torch.softmax(0.1 * q[r].double() @ rows.T, -1)
        ref[r] = p @ rows
    print(dt, "max|main-branch| %.3g" % (outs[0] - outs[1]).abs().max().item(),
          "main vs f64 %.3g" % (outs[0].double() - ref).abs().max().item(),
          "branch vs f64 %.3g" % (outs[1].double() - ref).abs().max().item())
