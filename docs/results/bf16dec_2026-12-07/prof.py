# perf-profile driver: the branch library's NativeMoeBlock in a loop (N calls), for `perf record`; same arguments as block_ab.py
# A/B of the presets' MoE blocks: main's library (A, path given) vs this tree's (B), both through
# NativeMoeBlock forced to take every size, and the module path with the fused-MoE kernel off
# (torch GEMMs per expert); alternated in one process, CPU time (process_time) per call.
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

import time
T=Ts[0]; x = torch.randn(T, H, generator=gen).to(dt); nb._lib=libB
with torch.no_grad():
    for _ in range(int(os.environ.get("N","600"))): nb(x)
