"""The whole DeepSeek-V2-Lite 200M MoE block (router, routing, routed experts, shared experts,
combine) through NativeMoeBlock, float32, one thread: the experts on torch's 4 KiB pages (A)
against a copy of the same blocks with the experts moved onto 2 MiB pages (B,
`move_to_huge_pages`), alternated round by round in one process, thread CPU ms per block call.
Decode: 32 rows, L = 7 blocks of distinct random weights cycled (more bytes than the LLC, as in
a decode step); prefill: 2048 rows, 2 blocks.
usage: OMP_NUM_THREADS=1 python block_hp.py [ROUNDS]"""
import copy, os, statistics, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
from types import SimpleNamespace
from pagedllm.layers.moe_routing import DeepseekRouting
from pagedllm.layers.quantization.base import process_weights_after_loading
from pagedllm.models.deepseek_v2 import DeepseekMoE
from pagedllm.huge_pages import move_to_huge_pages
from pagedllm.native.moe_block import NativeMoeBlock

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 11
gen = torch.Generator().manual_seed(0)


def make():
    blk = DeepseekMoE(SimpleNamespace(hidden_size=512, moe_intermediate_size=224,
                                      n_shared_experts=2, mlp_bias=False),
                      DeepseekRouting(64, 6, "softmax", "greedy"), "silu")
    for _, p in blk.named_parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    process_weights_after_loading(blk)
    huge = copy.deepcopy(blk)
    assert move_to_huge_pages(huge.experts.w13_weight) and move_to_huge_pages(huge.experts.w2_weight)
    natives = []
    for b in (blk, huge):
        nb = NativeMoeBlock.for_block(b)
        nb._max_pairs = 1 << 30
        natives.append(nb)
    return natives


for T, L in ((32, 7), (2048, 2)):
    pairs = [make() for _ in range(L)]
    xs = [torch.randn(T, 512, generator=gen) for _ in range(L)]
    res = {"A": [], "B": []}
    same = True
    with torch.no_grad():
        for r in range(rounds if T == 32 else max(3, rounds // 2)):
            outs = {}
            for lab in ("A", "B") if r % 2 == 0 else ("B", "A"):
                k = 0 if lab == "A" else 1
                t = time.thread_time()
                outs[lab] = [pair[k](x) for pair, x in zip(pairs, xs)]
                res[lab].append((time.thread_time() - t) / L * 1e3)
            same &= all(torch.equal(a, b) for a, b in zip(outs["A"], outs["B"]))
    ratios = [b / a for a, b in zip(res["A"], res["B"])]
    print(f"T={T}: ms per block, median of {len(ratios)}: 4K {statistics.median(res['A']):.3f}  "
          f"2M {statistics.median(res['B']):.3f}  2M/4K median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f} max {max(ratios):.3f})  outputs equal: {same}  "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
