"""One MLA layer call of `mla_cpu_paged` for a fresh batch-32 prefill step (32 requests x 128
new tokens, no cached prefix; or --context C cached tokens before each chunk) at the
`deepseek-v2-lite-200m` preset's attention shape (8 heads, L 128, dr 16, dn = dv = 32) or
V2-Lite's, three ways taking turns in one process: expanded with the attention in torch (SDPA,
the reference), expanded with the attention in the native kernel, absorbed in the native
kernel. Prints the median and best thread CPU time of each over --repeats rounds and the
largest difference from the torch form. usage: python prefill_ab.py [--shape 200m|v2-lite]
[--dtype float32|bfloat16] [--reqs 32] [--query-len 128] [--context 0] [--repeats 15]"""
import argparse
import statistics
import time

import numpy as np
import torch

from pagedllm.attention.backends.mla_cpu import MLACpuBackend
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import allocate_kv_cache, write_cache_rows

SHAPES = {"v2-lite": dict(H=16, L=512, DR=64, DN=128, DV=128),
          "200m": dict(H=8, L=128, DR=16, DN=32, DV=32)}
BLOCK = 16


def step(reqs, q_len, ctx, sh, dtype):
    gen = torch.Generator().manual_seed(0)
    seq = ctx + q_len
    nb = -(-seq // BLOCK)
    size = sh["L"] + sh["DR"]
    cache = allocate_kv_cache(reqs * nb + 1, BLOCK, 1, size, dtype, torch.device("cpu"), num_kv=1)
    table = np.random.default_rng(0).permutation(np.arange(1, reqs * nb + 1)).astype(np.int32)
    table = table.reshape(reqs, nb)
    pos = np.arange(seq)
    slots = [table[r, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK for r in range(reqs)]
    if ctx:
        old = np.concatenate([s[:ctx] for s in slots])
        write_cache_rows(cache, 0, torch.randn(len(old), 1, size, generator=gen).to(dtype),
                         torch.from_numpy(old))
    new = np.concatenate([s[ctx:] for s in slots])
    qsl = (np.arange(reqs + 1) * q_len).astype(np.int32)
    sl = np.full(reqs, seq, dtype=np.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(sl), seq_lens_cpu=sl, block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(new), num_reqs=reqs, num_actual_tokens=reqs * q_len,
        max_query_len=q_len, max_seq_len=seq, block_size=BLOCK, causal=True)
    n, h = reqs * q_len, sh["H"]
    return (torch.randn(n, h, sh["DN"], generator=gen).to(dtype),
            torch.randn(n, h, sh["DR"], generator=gen).to(dtype),
            torch.randn(n, size, generator=gen).to(dtype), cache, common,
            (0.1 * torch.randn(h, sh["DN"] + sh["DV"], sh["L"], generator=gen)).to(dtype))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="200m", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reqs", type=int, default=32)
    ap.add_argument("--query-len", type=int, default=128)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    q_nope, q_pe, latent, cache, common, w = step(a.reqs, a.query_len, a.context,
                                                  SHAPES[a.shape], dtype)
    ways = {"expanded torch": dict(prefill_form="expanded", expanded_in_kernel=False),
            "expanded kernel": dict(prefill_form="expanded"),
            "absorbed kernel": dict(prefill_form="absorbed")}
    times = {k: [] for k in ways}
    outs = {}
    for _ in range(a.repeats):
        for name, kw in ways.items():
            md = MLACpuBackend.build_metadata(common, **kw)
            t0 = time.thread_time()
            outs[name] = MLACpuBackend.forward(q_nope, q_pe, latent, cache, md, w, 0.1)
            times[name].append(time.thread_time() - t0)
    ref = outs["expanded torch"].double()
    print(f"{a.shape} {a.dtype} {a.reqs} x {a.query_len} over {a.context}, threads "
          f"{torch.get_num_threads()}, {a.repeats} rounds (thread CPU time)")
    for name in ways:
        print(f"  {name:16s} median {statistics.median(times[name]) * 1e3:7.2f} ms  best "
              f"{min(times[name]) * 1e3:7.2f} ms  max|diff| vs torch "
              f"{(outs[name].double() - ref).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
