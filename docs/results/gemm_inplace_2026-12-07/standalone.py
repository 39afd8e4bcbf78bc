# Standalone packed GEMM per shape: warm (repeated on one weight) and cold (after reading a
# FLUSH-MB buffer, so the weight comes from DRAM), ms per call (perf_counter around the call).
import ctypes, os, sys, time
import torch
from pagedllm.native.kernels.library import build_cpu_kernels
torch.set_num_threads(1)
lib = build_cpu_kernels()
V, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
f = lib.packed_linear_f32
dt = os.environ.get("DT", "float32")
fn = lib.packed_linear_f32 if dt == "float32" else lib.packed_linear_bf16
SHAPES = [(32, 16, 768), (32, 128, 768), (32, 768, 512), (32, 1024, 768), (32, 1552, 768), (32, 32000, 768)]
flush = torch.ones(int(os.environ.get("FLUSH", "512")) * 2**18)  # float32: MB * 2^18
reps = int(os.environ.get("REPS", "7"))
print("load", os.getloadavg())
for (m, n, k) in SHAPES:
    w = (torch.randn(n, k) / k ** 0.5).to(getattr(torch, dt))
    p = torch.empty_like(w)
    lib.pack_linear_weight(w.data_ptr(), n, k, 0 if dt == "float32" else 1, p.data_ptr())
    x = torch.randn(m, k); y = torch.empty(m, n)
    call = lambda: fn(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n)
    warm, cold = [], []
    for r in range(reps):
        flush.sum()
        t = time.perf_counter(); call(); cold.append(time.perf_counter() - t)
        for _ in range(3):
            t = time.perf_counter(); call(); warm.append(time.perf_counter() - t)
    mac = m * n * k
    wc, cc = sorted(warm)[len(warm)//2], sorted(cold)[len(cold)//2]
    print(f"{m}x{n}x{k}: warm median {wc*1e3:.3f} ms {mac/wc/1e9:.1f} GMAC/s (best {min(warm)*1e3:.3f}); cold median {cc*1e3:.3f} ms {mac/cc/1e9:.1f} (best {min(cold)*1e3:.3f})", flush=True)
print("load", os.getloadavg())
