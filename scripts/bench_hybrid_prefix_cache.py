"""Time to first token of a repeated prompt on a hybrid model, prefix caching mode "align" hit vs
miss, and the miss under mode "none" (what the checkpoint at the last block boundary costs: the
prefill ends there and the tail follows in a second step).

Builds a random-weight Qwen3-Next checkpoint (Gated DeltaNet and gated attention layers 3:1, no
download) in a temp folder and times `generate` with `max_tokens=1`:
  - miss: the prefix cache is reset before the request, so the whole prompt is computed;
  - hit:  the same prompt again: the states are restored from the checkpoint at the last block
          boundary and only the tokens after it are computed;
  - partial hit: a prompt sharing the first half of the missed one, then different tokens: it
          resumes from a checkpoint the scans emitted inside the miss's one prefill step.
Prints the median TTFT of each and their ratios (all figures from the same run).

    python scripts/bench_hybrid_prefix_cache.py [--hidden-size 256 --num-layers 4 --prompt-len 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The checkpoint and tokenizer builders live with the test fixtures.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams  # noqa: E402
from tests.fixtures.checkpoints import make_tiny_checkpoint  # noqa: E402
from tests.fixtures.tokenizers import build_byte_level_tokenizer  # noqa: E402


def build_checkpoint(root: Path, hidden_size: int, num_layers: int, max_len: int) -> Path:
    tokenizer_dir = build_byte_level_tokenizer(root / "tokenizer")
    return make_tiny_checkpoint(
        root / "model", "Qwen3NextForCausalLM", tokenizer_dir, hidden_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64,
        num_key_value_heads=1, head_dim=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=hidden_size,
        shared_expert_intermediate_size=hidden_size, intermediate_size=2 * hidden_size,
        max_position_embeddings=max_len, initializer_range=0.02)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one request (prefill + one sample), and its cached tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=128,
                        help="also sets the state slots (1 + 2 x this in mode align), which "
                             "bound the checkpoints one prefill step can keep")
    args = parser.parse_args()

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        max_len = 2 * args.prompt_len
        path = build_checkpoint(Path(tmp), args.hidden_size, args.num_layers, max_len)
        engines = {mode: LLM(str(path), dtype="float32", block_size=args.block_size,
                             max_num_batched_tokens=max_len, max_num_seqs=args.max_num_seqs,
                             mamba_cache_mode=mode, kv_cache_memory_bytes=256 << 20)
                   for mode in ("align", "none")}

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, 250) for _ in range(n)]

        for llm in engines.values():
            ttft(llm, tokens(args.prompt_len))  # warm-up (lazy init, allocator)
        miss, hit, none, partial, partial_cached = [], [], [], [], []
        expected = (args.prompt_len - 1) // args.block_size * args.block_size
        for _ in range(args.repeats):
            prompt = tokens(args.prompt_len)
            seconds, cached = ttft(engines["none"], prompt)
            assert cached == 0, cached
            none.append(seconds)
            engines["align"].reset_prefix_cache()
            seconds, cached = ttft(engines["align"], prompt)
            assert cached == 0, cached
            miss.append(seconds)
            seconds, hit_cached = ttft(engines["align"], prompt)
            assert hit_cached == args.prompt_len - args.prompt_len % args.block_size or \
                hit_cached == expected, hit_cached
            hit.append(seconds)
            half = prompt[:args.prompt_len // 2] + tokens(args.prompt_len - args.prompt_len // 2)
            seconds, cached = ttft(engines["align"], half)
            partial.append(seconds)
            partial_cached.append(cached)

    none_s, miss_s, hit_s, part_s = (statistics.median(x) for x in (none, miss, hit, partial))
    print(f"model: random Qwen3-Next, hidden {args.hidden_size}, {args.num_layers} layers "
          f"(3 Gated DeltaNet : 1 attention), float32; prompt {args.prompt_len} tokens; "
          f"block_size {args.block_size}; {args.repeats} repeats")
    print(f"TTFT mode none (no hit):  {none_s * 1e3:8.1f} ms (median; min {min(none) * 1e3:.1f})")
    print(f"TTFT mode align, miss:    {miss_s * 1e3:8.1f} ms (median; min {min(miss) * 1e3:.1f})")
    print(f"TTFT mode align, hit:     {hit_s * 1e3:8.1f} ms (median; min {min(hit) * 1e3:.1f}; "
          f"{hit_cached} tokens from the cache)")
    print(f"TTFT mode align, half:    {part_s * 1e3:8.1f} ms (median; min "
          f"{min(partial) * 1e3:.1f}; {statistics.median(partial_cached):.0f} tokens from the "
          f"cache: first half shared)")
    print(f"hit vs miss: {miss_s / hit_s:.1f}x faster; half-shared vs miss: "
          f"{miss_s / part_s:.2f}x faster; align miss vs none: {miss_s / none_s:.2f}x")


if __name__ == "__main__":
    main()
