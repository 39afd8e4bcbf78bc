"""Per-op A/B of the Gated DeltaNet state kernels (csrc/cpu_state_scan.cpp) at the shapes of
qwen3-next-200m (key heads 4 x 64, value heads 8 x 64, conv 1024 channels x 4 taps), kernel
libraries given on the command line, alternated in one process, one thread, thread CPU time.

  decode:  32 one-token requests per call, 9 layers' states (9 x 4 MiB) called in turn, as a
           decode step does (each layer's states are cold when its turn comes)
  prefill: 11 fresh requests of 128 tokens (1408 tokens), one layer

usage: python ops_ab.py LIB.so [LIB.so ...]; DT=float32|bfloat16 picks the activations' dtype
(the conv window state is in that dtype too; the Gated DeltaNet block always passes float32
activations, its conv window in the model dtype: CONV_STATE=bfloat16 gives that case).
"""
import ctypes, os, sys, time
import numpy as np, torch
from pagedllm.native.kernels.state_scan import StateBatchArgs
torch.set_num_threads(1)
libs = [ctypes.CDLL(p) for p in sys.argv[1:]]
DT = getattr(torch, os.environ.get("DT", "float32"))
CS = getattr(torch, os.environ.get("CONV_STATE", os.environ.get("DT", "float32")))
codes = {torch.float32: 0, torch.bfloat16: 1}
Hk, Hv, D, C, K, L, SLOTS = 4, 8, 64, 1024, 4, 9, 65
gen = torch.Generator().manual_seed(0)


def case(R, T, init):
    n = R * T
    q = [torch.randn(n, Hk, D, generator=gen).to(DT) for _ in range(L)]
    k = [torch.randn(n, Hk, D, generator=gen).to(DT) for _ in range(L)]
    v = [torch.randn(n, Hv, D, generator=gen).to(DT) for _ in range(L)]
    g = [-torch.rand(n, Hv, generator=gen) * 0.5 for _ in range(L)]
    beta = [torch.rand(n, Hv, generator=gen) for _ in range(L)]
    x = [torch.randn(n, C, generator=gen).to(DT) for _ in range(L)]
    st = [torch.randn(SLOTS, Hv, D, D, generator=gen) * 0.1 for _ in range(L)]
    cst = [torch.randn(SLOTS, C, K - 1, generator=gen).to(CS) for _ in range(L)]
    slots = 1 + torch.randperm(SLOTS - 1, generator=gen)[:R]
    batch = StateBatchArgs(torch.arange(R + 1) * T, slots,
                           torch.full((R,), init, dtype=torch.bool), SLOTS)
    return dict(q=q, k=k, v=v, g=g, beta=beta, x=x, st=st, cst=cst, batch=batch, n=n)


w = torch.randn(C, K, generator=gen)


def delta(lib, c, st, outs, layers):
    for l in range(layers):
        rc = lib.gated_delta_rule_varlen_cpu(
            ctypes.c_void_p(c["batch"].ptr), ctypes.c_void_p(c["q"][l].data_ptr()),
            ctypes.c_void_p(c["k"][l].data_ptr()), ctypes.c_void_p(c["v"][l].data_ptr()),
            ctypes.c_void_p(c["g"][l].data_ptr()), ctypes.c_void_p(c["beta"][l].data_ptr()),
            ctypes.c_void_p(st[l].data_ptr()), ctypes.c_int64(Hv), ctypes.c_int64(Hk),
            ctypes.c_int64(D), ctypes.c_int64(D), ctypes.c_int(codes[DT]),
            ctypes.c_void_p(outs[l].data_ptr()))
        assert rc == 0


def conv(lib, c, st, outs, layers):
    for l in range(layers):
        rc = lib.causal_conv1d_varlen_cpu(
            ctypes.c_void_p(c["batch"].ptr), ctypes.c_void_p(c["x"][l].data_ptr()),
            ctypes.c_int64(C), ctypes.c_int64(C), ctypes.c_int64(K), ctypes.c_void_p(w.data_ptr()),
            None, ctypes.c_void_p(st[l].data_ptr()), ctypes.c_int(codes[CS]), ctypes.c_int(1),
            ctypes.c_void_p(outs[l].data_ptr()), ctypes.c_int(codes[DT]))
        assert rc == 0


def bench(name, fn, c, state_key, out_shape, out_dtype, layers, reps, rounds):
    res = []
    for lib in libs:   # one call from the same states: compare the results
        st = [s.clone() for s in c[state_key]]
        outs = [torch.empty(*out_shape, dtype=out_dtype) for _ in range(L)]
        fn(lib, c, st, outs, layers)
        res.append((st, outs))
    for i, (st, outs) in enumerate(res[1:], 1):
        a = st[:layers] + outs[:layers]; b = res[0][0][:layers] + res[0][1][:layers]
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        err = max(float((x.float() - y.float()).abs().max() / (y.float().abs().max() + 1e-30))
                  for x, y in zip(a, b))
        print(f"  {name}: lib {i} vs lib 0 bit-identical {same}, max rel diff {err:.2e}")
    times = [[] for _ in libs]
    for _ in range(rounds):
        for i, lib in enumerate(libs):
            st, outs = res[i]
            t = time.thread_time()
            for _ in range(reps):
                fn(lib, c, st, outs, layers)
            times[i].append((time.thread_time() - t) / reps / layers * 1e3)
    for p, t in zip(sys.argv[1:], times):
        print(f"  {name} {os.path.basename(p)}: median {np.median(t):.4f} ms per layer call, "
              f"min {np.min(t):.4f}")


dec = case(32, 1, True)
pre = case(11, 128, False)
print(f"DT={DT} conv state {CS} load {os.getloadavg()}")
bench("delta decode", delta, dec, "st", (32, Hv, D), torch.float32, L, 20, 30)
bench("conv decode", conv, dec, "cst", (32, C), DT, L, 20, 30)
bench("delta prefill", delta, pre, "st", (1408, Hv, D), torch.float32, 1, 2, 15)
bench("conv prefill", conv, pre, "cst", (1408, C), DT, 1, 4, 15)
print("load", os.getloadavg())
