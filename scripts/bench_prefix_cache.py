"""Time to first token with and without a cached prefix (issue #5; until `pagedllm bench` has it).

Builds a random-weight Llama checkpoint (no download) in a temp folder, then times `generate` with
`max_tokens=1` for prompts = a shared prefix (default 1,000 tokens) + a fresh suffix:
  - miss: the prefix cache is reset before each request, so the whole prompt is computed;
  - hit:  the prefix was computed by an earlier request, so only the suffix (plus the partial last
          block of the prefix) is computed.
Prompts are token-id lists, so the prefix is exact. Prints the median TTFT of each and their ratio.

    python scripts/bench_prefix_cache.py [--hidden-size 384 --num-layers 4 --prefix-len 1000]
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
    num_heads = hidden_size // 64
    return make_tiny_checkpoint(
        root / "model", "LlamaForCausalLM", tokenizer_dir, hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 64 * 64, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 3),
        max_position_embeddings=max_len, initializer_range=0.02)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one request (prefill + one sample), and its cached tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        max_len = 2 * (args.prefix_len + args.suffix_len)
        path = build_checkpoint(Path(tmp), args.hidden_size, args.num_layers, max_len)
        llm = LLM(str(path), dtype=args.dtype, enable_prefix_caching=True,
                  block_size=args.block_size, max_num_batched_tokens=max_len,
                  num_gpu_blocks_override=4 * max_len // args.block_size + 1)
        vocab = llm.get_tokenizer().vocab_size

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        prefix = tokens(args.prefix_len)
        ttft(llm, tokens(args.prefix_len + args.suffix_len))  # warm-up (lazy init, allocator)

        miss, hit = [], []
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            seconds, cached = ttft(llm, prefix + tokens(args.suffix_len))
            assert cached == 0, cached
            miss.append(seconds)
            seconds, cached = ttft(llm, prefix + tokens(args.suffix_len))
            expected = args.prefix_len // args.block_size * args.block_size
            assert cached == expected, (cached, expected)
            hit.append(seconds)

    miss_s, hit_s = statistics.median(miss), statistics.median(hit)
    prompt_len = args.prefix_len + args.suffix_len
    print(f"model: random Llama, hidden {args.hidden_size}, {args.num_layers} layers, "
          f"{args.dtype}; prompt {prompt_len} tokens = {args.prefix_len} shared prefix + "
          f"{args.suffix_len} suffix; block_size {args.block_size}; {args.repeats} repeats")
    print(f"TTFT prefix not cached: {miss_s * 1e3:8.1f} ms (median; min {min(miss) * 1e3:.1f})")
    print(f"TTFT prefix cached:     {hit_s * 1e3:8.1f} ms (median; min {min(hit) * 1e3:.1f}; "
          f"{expected} tokens from the cache)")
    print(f"speed-up: {miss_s / hit_s:.1f}x")


if __name__ == "__main__":
    main()
