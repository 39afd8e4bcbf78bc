# A/B of the DeepSeek-V2-Lite-200M MoE block (hidden 512, 64 experts of 224, top-6, 2 shared):
# main's library (A, path given) vs this tree's (B) vs the module path (torch), alternated in one
# process; CPU time per call.  OMP_NUM_THREADS=1 python moe_block_ab.py MAIN_LIB.so 32 2048
import os, sys, time, ctypes
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
from types import SimpleNamespace
from pagedllm.layers.moe_routing import DeepseekRouting
from pagedllm.layers.quantization.base import process_weights_after_loading
from pagedllm.models.deepseek_v2 import DeepseekMoE
from pagedllm.native.moe_block import NativeMoeBlock
from pagedllm.native.kernels import abi, cpu_kernels
pathA = sys.argv[1]
Ts = [int(t) for t in sys.argv[2:]] or [32, 2048]
gen = torch.Generator().manual_seed(0)
ds = DeepseekMoE(SimpleNamespace(hidden_size=512, moe_intermediate_size=224, n_shared_experts=2, mlp_bias=False),
                 DeepseekRouting(64, 6, "softmax", "greedy"), "silu")
for name, p in ds.named_parameters():
    p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
process_weights_after_loading(ds)
libB = cpu_kernels(); libA = ctypes.CDLL(pathA); abi.declare(libA)
nb = NativeMoeBlock.for_block(ds)
nb._max_pairs = 1 << 30
reps_total = int(os.environ.get("REPS", "40"))
for T in Ts:
    x = torch.randn(T, 512, generator=gen)
    ds.native_block = None
    with torch.no_grad():
        ref = ds(x)
    tot = {"A": 0.0, "B": 0.0, "torch": 0.0}
    outs = {}
    n = max(1, reps_total * 32 // T)
    rounds = 5
    for r in range(rounds):
        for lab in ("A", "B", "torch"):
            if lab == "torch":
                f = lambda: ds(x)
            else:
                nb._lib = libA if lab == "A" else libB
                f = lambda: nb(x)
            with torch.no_grad():
                outs[lab] = f()
                t = time.process_time()
                for _ in range(n): f()
            tot[lab] += (time.process_time() - t) / n / rounds
    print(f"T={T}: A(main) {tot['A']*1e3:.2f} ms  B(new) {tot['B']*1e3:.2f} ms  torch {tot['torch']*1e3:.2f} ms  "
          f"B/A {tot['B']/tot['A']:.3f}  B/torch {tot['B']/tot['torch']:.3f}  "
          f"max|B-torch| {(outs['B']-ref).abs().max().item():.1e} max|A-B| {(outs['A']-outs['B']).abs().max().item():.1e}", flush=True)
print("load", os.getloadavg())
