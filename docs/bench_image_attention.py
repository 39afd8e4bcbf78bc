"""One decoder layer's attention in a Gemma 3 image-prefill step: `torch_sdpa` (what `cpu_paged`
ran such steps through before it took `attend_until` itself) against `cpu_paged` (its native
kernel), and `cpu_paged` on the same step without image spans.

Heads as Gemma 3 270M (4 query heads, 1 KV head, head size 256), 16-token blocks, random K/V.
The two backends run interleaved (each repetition runs both), so both see the same machine load;
the metadata build (once per step) is charged at 1/6 to each layer. Run:

    PYTHONPATH=. python docs/bench_image_attention.py [float32|bfloat16]
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import numpy as np
import torch

from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.metadata import CommonAttentionMetadata

H, KVH, D, BLOCK = 4, 1, 256, 16
REPS, LAYERS = 20, 6


def make_step(ctx, q_lens, spans, dtype):
    """(q, k, v, kv_cache, common): requests with `ctx` cached and `q_lens` new tokens; image
    spans (request, first query index, end query index) see up to their last token."""
    ctx, q_lens = np.array(ctx), np.array(q_lens)
    seq = ctx + q_lens
    blocks = -(-seq // BLOCK)
    table = np.zeros((len(ctx), blocks.max()), np.int32)
    used = 1
    for r, nb in enumerate(blocks):
        table[r, :nb] = np.arange(used, used + nb)
        used += nb
    slots = np.concatenate([table[r, np.arange(c, s) // BLOCK].astype(np.int64) * BLOCK
                            + np.arange(c, s) % BLOCK for r, (c, s) in enumerate(zip(ctx, seq))])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    until = np.concatenate([np.arange(c, s) for c, s in zip(ctx, seq)])
    for r, a, b in spans:
        until[qsl[r] + a:qsl[r] + b] = ctx[r] + b - 1
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq.astype(np.int32)), seq_lens_cpu=seq.astype(np.int32),
        block_table=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots),
        num_reqs=len(ctx), num_actual_tokens=int(qsl[-1]), max_query_len=int(q_lens.max()),
        max_seq_len=int(seq.max()), block_size=BLOCK, attend_until=torch.from_numpy(until))
    n = int(qsl[-1])
    return (torch.randn(n, H, D).to(dtype), torch.randn(n, KVH, D).to(dtype),
            torch.randn(n, KVH, D).to(dtype), torch.randn(2, used + 1, BLOCK, KVH, D).to(dtype),
            common)


def layer_ms(backend, step) -> float:
    q, k, v, cache, common = step
    t = time.perf_counter()
    metadata = backend.build_metadata(common)
    build = time.perf_counter() - t
    t = time.perf_counter()
    backend.forward(q, k, v, cache, metadata, D ** -0.5)
    return (time.perf_counter() - t + build / LAYERS) * 1e3


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    torch.manual_seed(0)
    cases = {
        "4 fresh prompts of 301 tokens, a 256-token image each": ([0] * 4, [301] * 4,
                                                                  [(r, 20, 276) for r in range(4)]),
        "4 chunks of 281 after 20 cached, image first": ([20] * 4, [281] * 4,
                                                         [(r, 0, 256) for r in range(4)]),
        "1 fresh prompt of 1100 tokens, 4 images": ([0], [1100], [(0, 20 + 270 * i, 276 + 270 * i)
                                                                  for i in range(4)]),
    }
    for name, (ctx, q_lens, spans) in cases.items():
        step = make_step(ctx, q_lens, spans, dtype)
        text = (*step[:4], replace(step[4], attend_until=None))
        runs = {"torch_sdpa": [], "cpu_paged": [], "cpu_paged, no images": []}
        for _ in range(REPS):
            runs["torch_sdpa"].append(layer_ms(TorchSDPABackend, step))
            runs["cpu_paged"].append(layer_ms(CpuPagedBackend, step))
            runs["cpu_paged, no images"].append(layer_ms(CpuPagedBackend, text))
        best = {k: min(v) for k, v in runs.items()}
        med = {k: float(np.median(v)) for k, v in runs.items()}
        print(f"[{dtype}] {name}: " + ", ".join(
            f"{k} {best[k]:.1f} ms (median {med[k]:.1f})" for k in runs)
            + f"; torch_sdpa / cpu_paged {best['torch_sdpa'] / best['cpu_paged']:.2f}x best, "
            f"{med['torch_sdpa'] / med['cpu_paged']:.2f}x median")


if __name__ == "__main__":
    main()
