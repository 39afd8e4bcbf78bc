"""Time to first token of repeated prefixes: the OffloadingConnector's host tier vs recompute, in
one run (docs/kv_connectors.md; the issue's workload, scaled to a small CPU).

Builds a random-weight Llama checkpoint (no download), then for two engines, one with a host tier
(`kv_offloading_size`) and one without, sends N distinct prefixes (+ a fresh suffix, max_tokens=1,
one request at a time) twice. The device cache holds only a fraction of the prefixes, so by the
second pass every prefix has been evicted from it: without the tier the second pass recomputes
each prefix, with the tier it loads the prefix's blocks back. Prints the median TTFT of each
engine's second pass, their ratio, and checks that both engines produce the same tokens.

The tier runs twice, with synchronous and with asynchronous transfers (`async_transfers`:
loads per layer on a copy thread, each layer waiting only for its own, saves handed over right
after each layer's write). A third pass then times steps that both load and compute: each
tier-hit prompt together with a fresh prompt of the same length (one step: the hit's blocks
are loaded while the fresh prompt is computed, and the fresh prompt's blocks are saved). The
three engines live side by side and take each prompt in turn, so that a shared machine's
changing load falls on all of them alike.

    python scripts/bench_kv_offload.py [--num-prefixes 64 --prefix-len 512 --cache-tokens 4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams  # noqa: E402
from scripts.bench_prefix_cache import build_checkpoint  # noqa: E402


PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def timed(llm: LLM, prompts: list[list[int]]) -> tuple[float, list]:
    """One generate call of `prompts` (s) and its outputs."""
    start = time.perf_counter()
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return time.perf_counter() - start, outs


def interleaved(engines: dict[str, LLM], batches: list[list[list[int]]]
                ) -> dict[str, tuple[list[float], list[int], list[int]]]:
    """Each batch on every engine in turn (the order rotating from batch to batch, so the
    load of a shared machine hits every engine alike): per engine the times (s), the cached
    tokens and the first tokens."""
    results = {name: ([], [], []) for name in engines}
    names = list(engines)
    for i, batch in enumerate(batches):
        for name in names[i % len(names):] + names[:i % len(names)]:
            seconds, outs = timed(engines[name], batch)
            times, cached, tokens = results[name]
            times.append(seconds)
            cached.append(outs[0].num_cached_tokens)
            tokens += [o.outputs[0].token_ids[0] for o in outs]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prefixes", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--cache-tokens", type=int, default=4096,
                        help="device KV cache size in tokens")
    parser.add_argument("--tier-gib", type=float, default=1.0)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 250) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)]
    first = [p + [rng.randrange(3, 250) for _ in range(args.suffix_len)] for p in prefixes]
    second = [p + [rng.randrange(3, 250) for _ in range(args.suffix_len)] for p in prefixes]
    third = [p + [rng.randrange(3, 250) for _ in range(args.suffix_len)] for p in prefixes]
    fresh = [[rng.randrange(3, 250) for _ in range(args.prefix_len + args.suffix_len)]
             for _ in prefixes]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp), args.hidden_size, args.num_layers,
                                max(2048, args.prefix_len + args.suffix_len + 8))
        engine = dict(dtype="float32", block_size=args.block_size, max_num_seqs=4,
                      num_gpu_blocks_override=args.cache_tokens // args.block_size + 1,
                      max_num_batched_tokens=2048, num_scheduler_steps=1)
        engines = {name: LLM(str(path), **engine, **extra) for name, extra in (
            ("recompute", {}), ("tier sync", _tier(args.tier_gib, False)),
            ("tier async", _tier(args.tier_gib, True)))}
        for llm in engines.values():
            llm.generate(first, PARAMS, use_tqdm=False)
        # The second pass: each prompt alone (its TTFT). The third: each tier-hit prompt with
        # a fresh one, in one step that loads the first and computes (and saves) the second.
        results = interleaved(engines, [[p] for p in second])
        mixed = interleaved(engines, [[p, f] for p, f in zip(third, fresh)])
    for name, (times, cached, _) in results.items():
        print(f"{name:10s}: median TTFT {statistics.median(times) * 1e3:7.1f} ms over "
              f"{len(times)} prompts of {args.prefix_len + args.suffix_len} tokens; cached "
              f"tokens per prompt {statistics.median(cached):.0f}; load+compute step "
              f"{statistics.median(mixed[name][0]) * 1e3:7.1f} ms")
    median = {name: statistics.median(times) for name, (times, _, _) in results.items()}
    same = (results["recompute"][2] == results["tier sync"][2] == results["tier async"][2]
            and mixed["recompute"][2] == mixed["tier sync"][2] == mixed["tier async"][2])
    print(f"TTFT ratio recompute / tier: {median['recompute'] / median['tier sync']:.2f}x "
          f"(sync), {median['recompute'] / median['tier async']:.2f}x (async); async / sync "
          f"TTFT {median['tier async'] / median['tier sync']:.3f}, load+compute step "
          f"{statistics.median(mixed['tier async'][0]) / statistics.median(mixed['tier sync'][0]):.3f}"
          f"; tokens identical: {same}")


def _tier(gib: float, asynchronous: bool) -> dict:
    return {"kv_transfer_config": {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kv_offloading_size": gib,
                                      "async_transfers": asynchronous}}}


if __name__ == "__main__":
    main()
