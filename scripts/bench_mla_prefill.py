"""MLA prefill on the CPU: one layer's `mla_cpu_paged` call with a chunk in the absorbed form
(native paged kernel) against the expanded form (the native expanded kernel where the build has
it, else torch), in one run.

One request: a chunk of Q new tokens over a cached prefix of C tokens, at the attention shape
of DeepSeek-V2-Lite (16 heads, L 512, dr 64, dn = dv = 128) or of the `deepseek-v2-lite-200m`
bench preset (8 heads, L 128, dr 16, dn = dv = 32); random latent cache (block size 16, block
table a permutation). The two forms take turns within each repeat (so that the load of a shared
machine falls on both alike); prints the best time of each and expanded / absorbed. Times are
the process's CPU time (`time.process_time`: on a loaded shared machine the wall time counts
other processes' turns; with several threads it also counts OpenMP's spin waits). Not a test.

    python scripts/bench_mla_prefill.py [--shape v2-lite|200m] [--dtype bfloat16]
        [--query-lens 16 64 256] [--contexts 0 2048] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedllm.attention.backends.mla_cpu import MLACpuBackend
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import KV_CACHE_DTYPES, allocate_kv_cache, write_cache_rows

SHAPES = {"v2-lite": dict(H=16, L=512, DR=64, DN=128, DV=128),
          "200m": dict(H=8, L=128, DR=16, DN=32, DV=32)}
BLOCK = 16


def make_step(q_len: int, ctx: int, shape: dict, dtype: torch.dtype, cache_dtype: str):
    """(q_nope, q_pe, latent, cache, common, w_kv_b) of one chunk over a cached prefix."""
    gen = torch.Generator().manual_seed(0)
    seq_len = ctx + q_len
    blocks = -(-seq_len // BLOCK)
    size = shape["L"] + shape["DR"]
    cache = allocate_kv_cache(blocks + 1, BLOCK, 1, size, KV_CACHE_DTYPES.get(cache_dtype, dtype),
                              torch.device("cpu"), num_kv=1)
    table = np.random.default_rng(0).permutation(np.arange(1, blocks + 1)).astype(np.int32)
    slots = table[np.arange(seq_len) // BLOCK].astype(np.int64) * BLOCK + \
        np.arange(seq_len) % BLOCK
    write_cache_rows(cache, 0, torch.randn(seq_len, 1, size, generator=gen).to(dtype),
                     torch.from_numpy(slots))
    qsl = np.array([0, q_len], dtype=np.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        seq_lens_cpu=np.array([seq_len], dtype=np.int32),
        block_table=torch.from_numpy(table[None]), slot_mapping=torch.from_numpy(slots[ctx:]),
        num_reqs=1, num_actual_tokens=q_len, max_query_len=q_len, max_seq_len=seq_len,
        block_size=BLOCK, causal=True)
    h = shape["H"]
    return (torch.randn(q_len, h, shape["DN"], generator=gen).to(dtype),
            torch.randn(q_len, h, shape["DR"], generator=gen).to(dtype),
            torch.randn(q_len, size, generator=gen).to(dtype), cache, common,
            (0.05 * torch.randn(h, shape["DN"] + shape["DV"], shape["L"],
                                generator=gen)).to(dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"])
    parser.add_argument("--query-lens", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    print(f"shape {args.shape} {shape}, {args.dtype}, cache {args.cache_dtype}, "
          f"{args.threads} threads, best of {args.repeats} (CPU time)")
    print("| chunk Q | cached prefix C | absorbed | expanded "
          "| expanded / absorbed |")
    print("|---|---|---|---|---|")
    for ctx in args.contexts:
        for q_len in args.query_lens:
            q_nope, q_pe, latent, cache, common, w_kv_b = make_step(q_len, ctx, shape, dtype,
                                                                    args.cache_dtype)
            forms = {form: MLACpuBackend.build_metadata(common, form)
                     for form in ("absorbed", "expanded")}
            best = {k: float("inf") for k in forms}
            for _ in range(args.repeats):
                for name, metadata in forms.items():
                    t0 = time.process_time()
                    MLACpuBackend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b, 0.1)
                    best[name] = min(best[name], time.process_time() - t0)
            print(f"| {q_len} | {ctx} | {best['absorbed'] * 1e3:.2f} ms | "
                  f"{best['expanded'] * 1e3:.2f} ms | {best['expanded'] / best['absorbed']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
