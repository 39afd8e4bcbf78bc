"""Attention kernel time of the CPU paged kernel, per-token path vs query-tiled path, in one run.

Two steps (Llama-3-8B-like attention: 32 heads, 8 KV heads, head size 128, block size 16):
a 512-token chunk continuing a 4096-token context, and a batch of 8 fresh 512-token prefills
(all on the kernel). Prints the best of `--repeats` times per path and the ratio; not a test.

    python scripts/bench_query_tiled_attention.py [--dtype bfloat16] [--tiles 1 8 16 32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedllm.native.kernels import attention_ops as ops

H, KVH, D, BLOCK = 32, 8, 128, 16


def make_step(ctx: list[int], q_lens: list[int], dtype: torch.dtype):
    """Random cache and queries for requests with `ctx` cached tokens and `q_lens` new ones."""
    seq_lens = np.array([c + q for c, q in zip(ctx, q_lens)], dtype=np.int32)
    blocks = [-(-int(s) // BLOCK) for s in seq_lens]
    kv_cache = torch.randn(2, sum(blocks) + 1, BLOCK, KVH, D).to(dtype)
    perm = np.random.default_rng(0).permutation(np.arange(1, sum(blocks) + 1))
    table = np.zeros((len(ctx), max(blocks)), dtype=np.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used:used + nb]
        used += nb
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = torch.randn(int(qsl[-1]), H, D)
    return query, kv_cache, torch.from_numpy(table), qsl, seq_lens


def best_times(step, tiles: list[int], repeats: int) -> dict[int, float]:
    """Best time per query tile; the tiles take turns within each repeat, so that the load of
    a shared machine falls on all of them alike."""
    query, kv_cache, table, qsl, seq_lens = step
    rows = np.arange(len(seq_lens), dtype=np.int32)
    best = {t: float("inf") for t in tiles}
    for _ in range(repeats):
        for t in tiles:
            t0 = time.perf_counter()
            ops.paged_attention(query, kv_cache, table, qsl, seq_lens, rows, D ** -0.5,
                                query_tile=t)
            best[t] = min(best[t], time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tiles", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch threads {torch.get_num_threads()}, cache {args.dtype}")
    for name, ctx, q_lens in (("512 after 4096", [4096], [512]),
                              ("8 x 512 prefill", [0] * 8, [512] * 8)):
        step = make_step(ctx, q_lens, dtype)
        times = best_times(step, args.tiles, args.repeats)
        base = times[args.tiles[0]]
        print(name + ": " + ", ".join(f"tile {t}: {s * 1e3:.1f} ms ({base / s:.2f}x)"
                                      for t, s in times.items()))


if __name__ == "__main__":
    main()
