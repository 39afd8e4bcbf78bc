# A/B of the MoE block kernel: library A (built from BASE tree) vs B (this tree), alternated.
import os, sys, time, subprocess, ctypes
os.environ.setdefault("OMP_NUM_THREADS", "1")
base = os.environ.get("BASE", "/work/main")
pathA = subprocess.run([sys.executable, "-c", "from pagedllm.native.kernels import cpu_kernels; print(cpu_kernels()._name)"],
                       env={**os.environ, "PYTHONPATH": base}, cwd=base, capture_output=True, text=True).stdout.strip().splitlines()[-1]
Ts = [int(t) for t in sys.argv[1:]] or [32]
sys.argv = [sys.argv[0], "1"]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "moebench.py")).read().split("res = {}")[0])
from pagedllm.native.kernels import abi, cpu_kernels
libB = cpu_kernels(); libA = ctypes.CDLL(pathA); abi.declare(libA)
print("A", pathA, "\nB", libB._name)
reps = int(os.environ.get("REPS", "30"))
for name, block, H in (("deepseek", ds, 512), ("qwen3next", qn, 768)):
    nb = NativeMoeBlock.for_block(block)
    for T in Ts:
        x = torch.randn(T, H)
        outs = {}
        tot = {"A": 0.0, "B": 0.0}
        for r in range(5):
            for lab, lib in (("A", libA), ("B", libB)):
                nb._lib = lib
                outs[lab] = nb(x)
                t = time.process_time()
                for _ in range(max(1, reps * 32 // T)): nb(x)
                tot[lab] += (time.process_time() - t) / max(1, reps * 32 // T) / 5
        print(f"{name} T={T}: A {tot['A']*1e3:.2f} ms  B {tot['B']*1e3:.2f} ms  B/A {tot['B']/tot['A']:.3f}  "
              f"max|A-B| {(outs['A']-outs['B']).abs().max().item():.2e} equal {torch.equal(outs['A'], outs['B'])}", flush=True)
print("load", os.getloadavg())
