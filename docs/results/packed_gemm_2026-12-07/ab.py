# Per-op A/B of the packed GEMM: main's kernel library (OLD, built with PAGEDLLM_KERNEL_CACHE=
# /tmp/gemm-main-kernels from the main checkout) against this branch's (NEW, cache
# /tmp/gemm-kernels, or the .so files given as arguments: single-source experiment builds of
# cpu_packed_gemm.cpp), loaded in one process; thread CPU ms per call, best of REPS alternated
# rounds, one thread; "=" marks outputs bit-identical to OLD's. Usage:
#   OMP_NUM_THREADS=1 SHAPES=32x32000x512 DTYPES=float32,bfloat16 REPS=3 python ab.py [lib.so ...]
import ctypes, glob, os, sys, time
import torch
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
V, P_, I, D = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

def load(path):
    lib = ctypes.CDLL(path)
    for name in ("packed_linear_f32", "packed_linear_bf16", "packed_linear_bf16_act"):
        getattr(lib, name).argtypes = [V, I, I, I, V, I, V, V, I]
        getattr(lib, name).restype = None
    lib.pack_linear_weight.argtypes = [V, I, I, D, V]
    lib.pack_linear_weight.restype = None
    return lib

OLD = load(glob.glob("/tmp/gemm-main-kernels/*/libpagedllm_cpu.so")[0])
paths = sys.argv[1:] or glob.glob("/tmp/gemm-kernels/*/libpagedllm_cpu.so")[:1]
NEWS = [(os.path.basename(p).replace(".so", "").replace("exp_", "") if len(paths) > 1 else "new", load(p)) for p in paths]
for _, L in NEWS:
    L.packed_gemm_set_pairs_form.argtypes = [D]
forms = os.environ.get("FORMS", "dot,widen" if len(paths) == 1 else "widen").split(",")

SHAPES = [(32, 32000, 512), (32, 32000, 768), (1365, 32000, 512), (32, 2048, 512), (1, 32000, 512),
          (2048, 1536, 512), (32, 1536, 512)]
only = os.environ.get("SHAPES")
if only:
    SHAPES = [tuple(map(int, s.split("x"))) for s in only.split(",")]
dts = os.environ.get("DTYPES", "float32,bfloat16").split(",")
reps = int(os.environ.get("REPS", "3"))
for dt in dts:
    wdt = getattr(torch, dt)
    for (m, n, k) in SHAPES:
        w = (torch.randn(n, k) / k ** 0.5).to(wdt)
        x = torch.randn(m, k)
        variants = []
        for name, lib in [("old", OLD)] + NEWS:
            p = torch.empty_like(w)
            lib.pack_linear_weight(w.data_ptr(), n, k, 0 if dt == "float32" else 1, p.data_ptr())
            fn = lib.packed_linear_f32 if dt == "float32" else lib.packed_linear_bf16
            if name != "old" and dt == "bfloat16" and forms:
                for f in forms:
                    variants.append((f"{name}-{f}", lib, fn, p, f))
            else:
                variants.append((name, lib, fn, p, None))
        y = torch.empty(m, n)
        res = {v[0]: [] for v in variants}
        outs = {}
        calls = max(1, int(3e8 / (m * n * k)))
        for r in range(reps):
            for name, lib, fn, p, f in variants:
                if f is not None:
                    lib.packed_gemm_set_pairs_form(1 if f == "dot" else 2)
                fn(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n)
                t = time.thread_time()
                for _ in range(calls):
                    fn(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n)
                res[name].append((time.thread_time() - t) / calls)
                outs[name] = y.clone()
        base = outs["old"]
        line = f"{dt:8s} {m}x{n}x{k}:"
        for name, ts in res.items():
            t = min(ts)
            same = "=" if torch.equal(outs[name], base) else f"d{(outs[name]-base).abs().max().item():.1e}"
            line += f"  {name} {t*1e3:7.2f} ms {m*n*k/t/1e9:5.1f} GMAC/s {same}"
        print(line, flush=True)
print("load", os.getloadavg())
