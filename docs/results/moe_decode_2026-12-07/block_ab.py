"""The presets' whole MoE blocks (router, routing, routed experts, shared expert, combine) through
NativeMoeBlock: the starting point's kernel library (A, path given; its ABI-22 struct, the router
as rows) against this tree's (B),
alternated round by round in one process, thread CPU time per block call. Decode (32 rows):
L blocks of distinct random weights cycled (7 DeepSeek / 12 Qwen3-Next layers: more bytes than
the last-level cache, as in a decode step); prefill: 2 blocks, 2048 / 1365 rows. float32.
usage: OMP_NUM_THREADS=1 python block_ab.py OLD_LIB.so ds|qn [ROUNDS]"""
import ctypes, os, statistics, sys, time
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

path_a, preset = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 9
gen = torch.Generator().manual_seed(0)


def make():
    if preset == "ds":
        blk = DeepseekMoE(SimpleNamespace(hidden_size=512, moe_intermediate_size=224,
                                          n_shared_experts=2, mlp_bias=False),
                          DeepseekRouting(64, 6, "softmax", "greedy"), "silu")
    else:
        blk = SparseMoeBlock(768, 16, 2, 256, True, "silu", shared_expert_intermediate_size=512)
    for _, p in blk.named_parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    process_weights_after_loading(blk)
    nb = NativeMoeBlock.for_block(blk)
    nb._max_pairs = 1 << 30
    return nb


H = 512 if preset == "ds" else 768
lib_b = cpu_kernels()
lib_a = ctypes.CDLL(path_a)
abi.declare(lib_a)
# The starting point's MoeBlockWeights (ABI 22): this tree's without `router_packed`, the router
# given as its rows.
MoeBlockWeights = abi.struct("MoeBlockWeights")


class OldWeights(ctypes.Structure):
    _fields_ = [f for f in MoeBlockWeights._fields_ if f[0] != "router_packed"]


def run_a(nb, x):
    if not hasattr(nb, "_old"):
        nb(x[:1])   # builds nb._weights
        old = OldWeights()
        for name, _ in OldWeights._fields_:
            setattr(old, name, getattr(nb._weights, name))
        old.router = nb.router.weight.data_ptr()
        nb._old = old
    out = torch.empty_like(x)
    rc = lib_a.moe_block(ctypes.addressof(nb._old), x.data_ptr(), 0, x.shape[0], x.shape[1],
                         out.data_ptr())
    assert rc == 0
    return out
for T, L in ((32, 7 if preset == "ds" else 12), (2048 if preset == "ds" else 1365, 2)):
    blocks = [make() for _ in range(L)]
    xs = [torch.randn(T, H, generator=gen) for _ in range(L)]
    res = {"A": [], "B": []}
    diff = 0.0
    with torch.no_grad():
        for r in range(rounds):
            outs = {}
            for lab in ("A", "B") if r % 2 == 0 else ("B", "A"):
                run = run_a if lab == "A" else (lambda nb, x: nb(x))
                t = time.thread_time()
                outs[lab] = [run(nb, x) for nb, x in zip(blocks, xs)]
                res[lab].append((time.thread_time() - t) / L * 1e3)
            diff = max(diff, max((a - b).abs().max().item() for a, b in zip(outs["A"], outs["B"])))
    ratios = [b / a for a, b in zip(res["A"], res["B"])]
    print(f"{preset} T={T}: ms per block, median of {rounds}: A {statistics.median(res['A']):.3f}  "
          f"B {statistics.median(res['B']):.3f}  B/A median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f} max {max(ratios):.3f})  max |A-B| {diff:.2e}  "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
