import os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
sys.path.insert(0, os.getcwd())
from types import SimpleNamespace
from pagedllm.layers.moe_routing import DeepseekRouting
from pagedllm.layers.quantization.base import process_weights_after_loading
from pagedllm.models.deepseek_v2 import DeepseekMoE
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.native.moe_block import NativeMoeBlock

def rnd(block):
    gen = torch.Generator().manual_seed(0)
    for name, p in block.named_parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    process_weights_after_loading(block)

ds = DeepseekMoE(SimpleNamespace(hidden_size=512, moe_intermediate_size=224, n_shared_experts=2, mlp_bias=False),
                 DeepseekRouting(64, 6, "softmax", "greedy"), "silu"); rnd(ds)
qn = SparseMoeBlock(768, 16, 2, 256, True, "silu", shared_expert_intermediate_size=512); rnd(qn)
res = {}
for name, block, H in (("deepseek", ds, 512), ("qwen3next", qn, 768)):
    nb = NativeMoeBlock.for_block(block)
    for T in [int(t) for t in sys.argv[1:]] or [32, 2048]:
        x = torch.randn(T, H)
        ref = None
        block.native_block = None
        with torch.no_grad():
            ref = block(x)
        got = nb(x)
        err = (got - ref).abs().max().item()
        reps = int(os.environ.get("REPS", max(1, 20000 // T)))
        nb(x)
        t = time.process_time()
        for _ in range(reps): nb(x)
        d = (time.process_time() - t) / reps
        print(f"{name} T={T}: {d*1e3:.2f} ms/call cpu  (max |native-module| {err:.2e})", flush=True)
print("load", os.getloadavg())
