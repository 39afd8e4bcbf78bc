# Per-op A/B of packed GEMM builds loaded in one process: the first .so is the reference
# ("old"), the others are compared with it; thread CPU ms per call, best of REPS alternated
# rounds, one thread; "=" marks outputs bit-identical to the reference's. bf16 weights use the
# widening pair form (FORM=dot for vdpbf16ps). Builds: single-source libraries of
# cpu_packed_gemm.cpp (g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17).
# Usage: OMP_NUM_THREADS=1 SHAPES=32x32000x768,... DTYPES=bfloat16,float32 REPS=5 \
#        python gemm_ab.py old.so new.so [...]
import ctypes, os, sys, time
import torch
torch.set_num_threads(1)
V, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

def load(path):
    lib = ctypes.CDLL(path)
    for name in ("packed_linear_f32", "packed_linear_bf16", "packed_linear_bf16_act"):
        getattr(lib, name).argtypes = [V, I, I, I, V, I, V, V, I]
        getattr(lib, name).restype = None
    lib.pack_linear_weight.argtypes = [V, I, I, D, V]
    lib.pack_linear_weight.restype = None
    lib.packed_gemm_set_pairs_form.argtypes = [D]
    lib.packed_gemm_set_pairs_form(1 if os.environ.get("FORM") == "dot" else 2)
    return lib

libs = [(os.path.basename(p).replace(".so", ""), load(p)) for p in sys.argv[1:]]
SHAPES = [(32, 32000, 768), (32, 1552, 768), (32, 768, 512), (32, 1024, 768), (32, 128, 768),
          (1365, 1552, 768), (1365, 1024, 768), (1365, 768, 512), (1, 1552, 768)]
if os.environ.get("SHAPES"):
    SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ["SHAPES"].split(",")]
reps = int(os.environ.get("REPS", "5"))
for dt in os.environ.get("DTYPES", "bfloat16").split(","):
    wdt = getattr(torch, dt)
    for (m, n, k) in SHAPES:
        w = (torch.randn(n, k) / k ** 0.5).to(wdt)
        x = torch.randn(m, k)
        packs = []
        for name, lib in libs:
            p = torch.empty_like(w)
            lib.pack_linear_weight(w.data_ptr(), n, k, 0 if dt == "float32" else 1, p.data_ptr())
            packs.append(p)
        y = torch.empty(m, n)
        res, outs = {name: [] for name, _ in libs}, {}
        calls = max(1, int(3e8 / (m * n * k)))
        for r in range(reps):
            for (name, lib), p in zip(libs, packs):
                fn = lib.packed_linear_f32 if dt == "float32" else lib.packed_linear_bf16
                fn(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n)
                t = time.thread_time()
                for _ in range(calls):
                    fn(x.data_ptr(), k, m, k, p.data_ptr(), n, None, y.data_ptr(), n)
                res[name].append((time.thread_time() - t) / calls)
                outs[name] = y.clone()
        base = outs[libs[0][0]]
        line = f"{dt:8s} {m}x{n}x{k}:"
        for name, ts in res.items():
            t = min(ts)
            same = "=" if torch.equal(outs[name], base) else f"d{(outs[name]-base).abs().max().item():.1e}"
            line += f"  {name} {t*1e3:7.3f} ms {m*n*k/t/1e9:5.1f} {same}"
        print(line, flush=True)
print("load", os.getloadavg())
