# Usage: OLDLIB=<main build>.so NEWLIB=<experiment build>.so OMP_NUM_THREADS=1 python ab.py [MxNxK,...]  (bf16: dot/widen forms)
# thread CPU ms per call: main's library vs the branch's, alternated; bit-equality check.
import ctypes, glob, os, sys, time, torch
torch.set_num_threads(1)
V, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
def load(path):
    lib = ctypes.CDLL(path)
    for name in ("packed_linear_f32", "packed_linear_bf16", "packed_linear_bf16_act"):
        getattr(lib, name).argtypes = [V, I, I, I, V, I, V, V, I]; getattr(lib, name).restype = None
    lib.pack_linear_weight.argtypes = [V, I, I, D, V]; lib.pack_linear_weight.restype = None
    lib.packed_gemm_set_pairs_form.argtypes = [D]
    return lib
OLD = load(os.environ["OLDLIB"])
NEW = load(os.environ["NEWLIB"])
shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[1] if len(sys.argv) > 1 else
          "2048x4096x768,2048x768x2048,2048x2304x768,2048x768x3072,656x3456x640,48x768x768,24x512x512,30x1000x264").split(",")]
for m, n, k in shapes:
    w = (torch.randn(n, k) / k ** 0.5).bfloat16(); x = torch.randn(m, k).bfloat16()
    res, outs = {}, {}
    for name, lib in (("old", OLD), ("new", NEW)):
        p = torch.empty_like(w); lib.pack_linear_weight(w.data_ptr(), n, k, 1, p.data_ptr())
        res[name] = (lib, p)
    times = {}
    for r in range(3):
        for name, (lib, p) in res.items():
            for form in ("dot", "widen"):
                if name == "new" and form == "dot": continue
                lib.packed_gemm_set_pairs_form(1 if form == "dot" else 2)
                y = torch.empty(m, n, dtype=torch.bfloat16)
                t = time.thread_time()
                lib.packed_linear_bf16_act(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n)
                t = time.thread_time() - t
                key = f"{name}-{form}"
                times[key] = min(times.get(key, 1e9), t); outs[key] = y
    ref = outs["old-dot"]
    print(f"{m}x{n}x{k}: " + "  ".join(f"{key} {t*1e3:.1f}ms {m*n*k/t/1e9:.0f}GMAC/s{'=' if torch.equal(outs[key].view(torch.int16), ref.view(torch.int16)) else '!'}" for key, t in times.items()))
