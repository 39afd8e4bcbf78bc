# Usage: OLDLIB=<main build>.so NEWLIB=<experiment build>.so OMP_NUM_THREADS=1 python ab32.py MxNxK,... float32,bfloat16
# float32 packed GEMM: main's library vs the branch's, thread CPU, alternated, bit check.
import ctypes, os, sys, time, torch
torch.set_num_threads(1)
V, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
def load(path):
    lib = ctypes.CDLL(path)
    for name in ("packed_linear_f32", "packed_linear_bf16", "packed_linear_bf16_act"):
        getattr(lib, name).argtypes = [V, I, I, I, V, I, V, V, I]; getattr(lib, name).restype = None
    lib.pack_linear_weight.argtypes = [V, I, I, D, V]; lib.pack_linear_weight.restype = None
    lib.packed_gemm_set_pairs_form.argtypes = [D]
    return lib
libs = {"main": load(os.environ["OLDLIB"]), "new": load(os.environ["NEWLIB"])}
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")]
for dt in sys.argv[2].split(","):
  for m, n, k in shapes:
    w = (torch.randn(n, k) / k ** 0.5).to(getattr(torch, dt)); x = torch.randn(m, k).to(getattr(torch, dt))
    packed = {}
    for name, lib in libs.items():
        p = torch.empty_like(w); lib.pack_linear_weight(w.data_ptr(), n, k, 0 if dt == "float32" else 1, p.data_ptr()); packed[name] = p
    times, outs = {}, {}
    for r in range(3):
        for name, lib in libs.items():
            fn = lib.packed_linear_f32 if dt == "float32" else lib.packed_linear_bf16_act
            y = torch.empty(m, n, dtype=w.dtype)
            t = time.thread_time(); fn(x.data_ptr(), k, m, k, packed[name].data_ptr(), n, None, y.data_ptr(), n); t = time.thread_time() - t
            times[name] = min(times.get(name, 1e9), t); outs[name] = y
    eq = torch.equal(outs["main"], outs["new"])
    print(f"{dt} {m}x{n}x{k}: " + "  ".join(f"{a} {t*1e3:.1f}ms {m*n*k/t/1e9:.0f}GMAC/s" for a, t in times.items()) + f"  bits equal: {eq}", flush=True)
