# A/B of the presets' MoE blocks: main's library (A, path given) vs this tree's (B), both through
# NativeMoeBlock forced to take every size, and the module path with the fused-MoE kernel off
# (torch GEMMs per expert); alternated in one process, CPU time (process_time) per call.
#   NLAB=2 runs A and B only (the torch column then reads 1000 ms and is not a measurement).
#   OMP_NUM_THREADS=1 python block_ab.py MAIN_LIB.so ds|qn float32|bfloat16 32 2048
import os, sys, time, ctypes
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
from types import SimpleNamespace
from pagedllm.layers.moe_routing import DeepseekRouting
from pagedllm.layers.quantization.base import process_weights_after_loading
from pagedllm.models.deepseek_v2 import DeepseekMoE
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.native.moe_block import NativeMoeBlock
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.platforms import current_platform
pathA, preset, dt = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
Ts = [int(t) for t in sys.argv[4:]] or [32, 2048]
gen = torch.Generator().manual_seed(0)
if preset == "ds":
    H = 512
    blk = DeepseekMoE(SimpleNamespace(hidden_size=512, moe_intermediate_size=224, n_shared_experts=2,
                                      mlp_bias=False), DeepseekRouting(64, 6, "softmax", "greedy"), "silu")
else:
    H = 768
    blk = SparseMoeBlock(768, 16, 2, 256, True, "silu", shared_expert_intermediate_size=512)
for name, p in blk.named_parameters():
    p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
blk = blk.to(dt)
if preset == "ds":
    blk.gate.float()
process_weights_after_loading(blk)
libB = cpu_kernels(); libA = ctypes.CDLL(pathA); abi.declare(libA)
nb = NativeMoeBlock.for_block(blk)
nb._max_pairs = 1 << 30
blk.native_block = None
def torch_path(x):
    os.environ["PAGEDLLM_CPU_FUSED_MOE"] = "0"; current_platform.configure_options()
    try:
        return blk(x)
    finally:
        del os.environ["PAGEDLLM_CPU_FUSED_MOE"]; current_platform.configure_options()
for T in Ts:
    x = torch.randn(T, H, generator=gen).to(dt)
    tot = {"A": 0.0, "B": 0.0, "torch": 0.0}; outs = {}
    n = max(1, int(os.environ.get("REPS", "40")) * 32 // T)
    rounds = int(os.environ.get("ROUNDS", "5"))
    best = {k: 1e9 for k in tot}
    for r in range(rounds):
        for lab in ("A", "B", "torch")[:int(os.environ.get("NLAB","3"))]:
            if lab == "torch":
                os.environ["PAGEDLLM_CPU_FUSED_MOE"] = "0"; current_platform.configure_options()
                f = lambda: blk(x)
            else:
                nb._lib = libA if lab == "A" else libB
                f = lambda: nb(x)
            with torch.no_grad():
                outs[lab] = f()
                t = time.process_time()
                for _ in range(n): f()
                dtm = (time.process_time() - t) / n
            if lab == "torch":
                del os.environ["PAGEDLLM_CPU_FUSED_MOE"]; current_platform.configure_options()
            tot[lab] += dtm / rounds; best[lab] = min(best[lab], dtm)
    if "torch" not in outs: tot["torch"]=best["torch"]=1.0; outs["torch"]=outs["B"]
    d = lambda a, b: (outs[a].float() - outs[b].float()).abs().max().item()
    print(f"{preset} {sys.argv[3]} T={T}: mean A(main) {tot['A']*1e3:.2f} B(new) {tot['B']*1e3:.2f} torch {tot['torch']*1e3:.2f} ms | "
          f"best A {best['A']*1e3:.2f} B {best['B']*1e3:.2f} torch {best['torch']*1e3:.2f} | B/A {tot['B']/tot['A']:.3f} "
          f"B/torch {tot['B']/tot['torch']:.3f} | max|B-torch| {d('B','torch'):.1e} max|A-B| {d('A','B'):.1e}", flush=True)
print("load", os.getloadavg())
