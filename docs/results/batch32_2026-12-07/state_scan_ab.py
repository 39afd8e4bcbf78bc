"""A/B of the conv and delta-rule kernels: the library at $BASE_LIB (A, e.g. built from main) vs this tree's (B), alternated in one process; thread CPU ms per call, qwen3-next-200m shapes."""
import ctypes, os, sys, time, torch
from pagedllm.native.kernels import abi, cpu_kernels, state_scan
libB = cpu_kernels(); libA = ctypes.CDLL(os.environ["BASE_LIB"]); abi.declare(libA)
torch.manual_seed(0)
for M, R in ((32, 32), (1408, 11)):
    per = M // R; slots = R + 1
    batch = state_scan.StateBatchArgs(torch.arange(0, R + 1) * per, torch.arange(1, R + 1), torch.ones(R, dtype=torch.bool), slots)
    x = torch.randn(M, 1552); w = torch.randn(1024, 4).contiguous()
    conv0 = torch.randn(slots, 1024, 3)
    q = torch.randn(M, 4, 64); k = torch.randn(M, 4, 64); v = torch.randn(M, 8, 64)
    g = -torch.rand(M, 8); beta = torch.rand(M, 8); rec0 = torch.randn(slots, 8, 64, 64) * 0.1
    def conv(lib, st):
        out = torch.empty(M, 1024)
        assert lib.causal_conv1d_varlen_cpu(batch.ptr, x.data_ptr(), 1552, 1024, 4, w.data_ptr(), None, st.data_ptr(), 0, 1, out.data_ptr(), 0) == 0
        return out
    def delta(lib, st):
        out = torch.empty(M, 8, 64)
        assert lib.gated_delta_rule_varlen_cpu(batch.ptr, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), st.data_ptr(), 8, 4, 64, 64, 0, out.data_ptr()) == 0
        return out
    for name, f, s0 in (("conv", conv, conv0), ("delta", delta, rec0)):
        res = {}
        for lab, lib in (("A", libA), ("B", libB)):
            st = s0.clone(); res[lab] = (f(lib, st), st)
        d = max((res["A"][0] - res["B"][0]).abs().max().item(), (res["A"][1] - res["B"][1]).abs().max().item())
        tot = {"A": 0.0, "B": 0.0}; reps = 200 if M < 100 else 10
        for r in range(5):
            for lab, lib in (("A", libA), ("B", libB)):
                st = s0.clone(); t = time.thread_time()
                for _ in range(reps): f(lib, st)
                tot[lab] += (time.thread_time() - t) / reps / 5
        print(f"M={M} R={R} {name}: A {tot['A']*1e3:.3f} ms  B {tot['B']*1e3:.3f} ms  B/A {tot['B']/tot['A']:.3f}  max|A-B| {d:.2e}")
print("load", os.getloadavg())
