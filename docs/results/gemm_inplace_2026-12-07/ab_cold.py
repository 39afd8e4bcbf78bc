# Per-op A/B of packed GEMM builds in one process, cold (after reading a FLUSH-MB buffer) and
# warm (the call repeated), alternated per round; median ms per call; "=" bit-identical outputs.
import ctypes, os, sys, time
import torch
torch.set_num_threads(1)
V, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
def load(path):
    lib = ctypes.CDLL(path)
    for name in ("packed_linear_f32", "packed_linear_bf16"):
        getattr(lib, name).argtypes = [V, I, I, I, V, I, V, V, I]; getattr(lib, name).restype = None
    lib.pack_linear_weight.argtypes = [V, I, I, D, V]; lib.pack_linear_weight.restype = None
    return lib
libs = [(os.path.basename(p).replace(".so", ""), load(p)) for p in sys.argv[1:]]
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "32x768x512,32x1024x768,32x1552x768,32x32000x768").split(",")]
flush = torch.ones(int(os.environ.get("FLUSH", "400")) * 2**18)
reps = int(os.environ.get("REPS", "9"))
dt = os.environ.get("DT", "float32")
print("load", os.getloadavg(), dt, flush=True)
for (m, n, k) in SHAPES:
    w = (torch.randn(n, k) / k ** 0.5).to(getattr(torch, dt))
    # one weight copy per lib (same packing code), so each cold call reads its own
    packs = []
    for name, lib in libs:
        p = torch.empty_like(w); lib.pack_linear_weight(w.data_ptr(), n, k, 0 if dt == "float32" else 1, p.data_ptr()); packs.append(p)
    x = torch.randn(m, k); y = torch.empty(m, n)
    cold = {nm: [] for nm, _ in libs}; warm = {nm: [] for nm, _ in libs}; outs = {}
    for r in range(reps):
        for (nm, lib), p in (list(zip(libs, packs)) if r % 2 == 0 else list(zip(libs, packs))[::-1]):
            fn = lib.packed_linear_f32 if dt == "float32" else lib.packed_linear_bf16
            flush.sum()
            t = time.perf_counter(); fn(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n); cold[nm].append(time.perf_counter() - t)
            t = time.perf_counter(); fn(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n); warm[nm].append(time.perf_counter() - t)
            outs[nm] = y.clone()
    base = outs[libs[0][0]]
    line = f"{m}x{n}x{k}:"
    med = lambda v: sorted(v)[len(v) // 2]
    for nm in cold:
        same = "=" if torch.equal(outs[nm], base) else "!"
        line += f"  {nm} cold {med(cold[nm])*1e3:.3f} warm {med(warm[nm])*1e3:.3f}{same}"
    print(line, flush=True)
print("load", os.getloadavg())
