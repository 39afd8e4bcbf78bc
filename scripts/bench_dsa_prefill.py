"""DSA prefill on the CPU: one layer's DSA forward (`dsa_torch`, or `dsa_cpu_paged`'s native
kernels with --backend cpu) over a whole prompt of Q tokens (the
indexer's scores and top-k, then sparse MLA over the selected latents), at the attention shape
of one tensor-parallel rank of 8 of DeepSeek-V3.2 (16 heads, L 512, dr 64, dn = dv = 128; the
indexer's 64 heads of 128). Random latent and indexer caches (block size 16, block table a
permutation); prints the best wall and CPU time (`time.process_time`, all threads) of `--repeats` per
prompt length. Not a test.

    python scripts/bench_dsa_prefill.py [--prompt-lens 1024 4096] [--index-topk 256]
        [--repeats 2] [--threads 2] [--backend torch|cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.attention.backends.dsa_cpu import DSACpuBackend
from pagedllm.attention.backends.dsa_torch import DSATorchBackend, IndexerInputs
from pagedllm.indexer_cache_layout import allocate_indexer_cache
from scripts.bench_mla_prefill import BLOCK, SHAPES, make_step

INDEX_HEADS, INDEX_DIM = 64, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--index-topk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--backend", choices=["torch", "cpu"], default="torch")
    args = parser.parse_args()
    backend = DSACpuBackend if args.backend == "cpu" else DSATorchBackend
    torch.set_num_threads(args.threads)
    print(f"{backend.name}, index_topk {args.index_topk}, {args.threads} threads, best of {args.repeats}")
    for q_len in args.prompt_lens:
        q_nope, q_pe, latent, cache, common, w_kv_b = make_step(q_len, 0, SHAPES["v2-lite"],
                                                                torch.float32, "auto")
        gen = torch.Generator().manual_seed(1)
        indexer = IndexerInputs(
            q=torch.randn(q_len, INDEX_HEADS, INDEX_DIM, generator=gen),
            k=torch.randn(q_len, INDEX_DIM, generator=gen),
            weights=torch.randn(q_len, INDEX_HEADS, generator=gen) * INDEX_HEADS ** -0.5,
            cache=allocate_indexer_cache(cache.shape[1], BLOCK, INDEX_DIM, torch.float32,
                                         torch.device("cpu")),
            scale=INDEX_DIM ** -0.5, topk=args.index_topk)
        metadata = backend.build_metadata(common)
        wall = cpu = float("inf")
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            backend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b, 0.1, indexer)
            wall = min(wall, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
        print(f"prompt {q_len}: {wall:.2f} s wall, {cpu:.2f} s CPU per layer", flush=True)


if __name__ == "__main__":
    main()
