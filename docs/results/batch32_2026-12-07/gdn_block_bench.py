"""Micro-bench of a Qwen3-Next-200M Gated DeltaNet / gated-attention half at M rows (decode: M
requests of one token; prefill: R requests of M/R tokens). Thread CPU ms per call.
usage: gdnbench.py M [R] [reps]"""
import ctypes, os, sys, time
import torch
from transformers import AutoConfig
from pagedllm.benchmarks.presets import preset_path
from pagedllm.models.qwen3_next import Qwen3NextDecoderLayer
from pagedllm.layers.quantization.base import process_weights_after_loading
from pagedllm.native import gdn_decoder as G
from pagedllm.native.kernels import state_scan, ops
torch.manual_seed(0)
M = int(sys.argv[1]); R = int(sys.argv[2]) if len(sys.argv) > 2 else M
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
cfg = AutoConfig.from_pretrained(preset_path("qwen3-next-200m", "float32"))
layer = Qwen3NextDecoderLayer(cfg, 0, "linear_attention")
for p in layer.parameters(): p.data.normal_(0, 0.05)
mixer = layer.linear_attn
mixer.A_log.data.uniform_(-1, 1)
process_weights_after_loading(layer)
slots = R + 1
conv = torch.randn(slots, mixer.conv_dim, 3) * 0.1
rec = torch.randn(slots, mixer.num_v_heads, 64, 64) * 0.01
mixer.state.states = [conv, rec]
nm = G.NativeGDNMixer(layer, G.GDNScratch())
nm._build((conv, rec))
per = M // R
qsl = torch.arange(0, R + 1) * per
batch = state_scan.StateBatchArgs(qsl, torch.arange(1, R + 1), torch.ones(R, dtype=torch.bool), slots)
hidden = torch.randn(M, cfg.hidden_size)
def native():
    out, pn = torch.empty_like(hidden), torch.empty_like(hidden)
    sc = nm.scratch.get(M * nm.scratch_floats)
    rc = nm._lib.gdn_decoder_mixer(ctypes.addressof(nm._struct), batch.ptr, M, hidden.data_ptr(),
                                   out.data_ptr(), pn.data_ptr(), sc.data_ptr(), 0)
    assert rc == 0
    return out
x = torch.randn(M, cfg.hidden_size); qkv = torch.randn(M, mixer.conv_dim); o_in = torch.randn(M, 512)
qq = torch.randn(M, 4, 64); kk = torch.randn(M, 4, 64); vv = torch.randn(M, 8, 64)
g = -torch.rand(M, 8); beta = torch.rand(M, 8)
cw = mixer.conv1d.weight[:, 0]
parts = {
    "whole native mixer": native,
    "in_proj_qkv": lambda: mixer.in_proj_qkv(x),
    "in_proj_z": lambda: mixer.in_proj_z(x),
    "in_proj_b+a": lambda: (mixer.in_proj_b(x), mixer.in_proj_a(x)),
    "out_proj": lambda: mixer.out_proj(o_in),
    "conv": lambda: state_scan.causal_conv1d_varlen_cpu(qkv, cw, None, conv, batch, True),
    "delta rule": lambda: state_scan.gated_delta_rule_varlen_cpu(qq, kk, vv, g, beta, rec, batch),
}
tot = {k: 0.0 for k in parts}
for k, f in parts.items(): f()
for r in range(reps):
    for k, f in parts.items():
        t = time.thread_time(); f(); tot[k] += time.thread_time() - t
for k, v in tot.items():
    print(f"M={M} R={R} {k:22s} {v / reps * 1e3:8.3f} ms")
print("load", os.getloadavg()[0])
