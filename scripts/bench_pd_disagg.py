"""Prefill/decode disaggregation (P2pShmConnector) against one engine, in one run
(docs/kv_connectors.md).

Builds a random-weight Llama checkpoint (no download) and three engines in this process: one
alone, a prefill instance (kv_producer) and a decode instance (kv_consumer). For N distinct
prompts, one request at a time, it times:
  - alone: the first token of the single engine (its prefill);
  - prefill: the prefill instance's max_tokens=1 request (the prompt plus the export to shared
    memory);
  - decode: the decode instance's first token (the pull, loading the blocks, one token's
    forward): what a decode instance spends on a prompt instead of its prefill.
Then checks that greedy outputs of `--max-tokens` tokens are identical both ways.

    python scripts/bench_pd_disagg.py [--num-prompts 16 --prompt-len 1024]
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams  # noqa: E402
from scripts.bench_prefix_cache import build_checkpoint  # noqa: E402


def _params(max_tokens: int, kv_transfer_params: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=None if kv_transfer_params is None
                          else {"kv_transfer_params": kv_transfer_params})


def _timed(llm: LLM, prompt: list[int], params: SamplingParams):
    start = time.perf_counter()
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-layers", type=int, default=4)
    args = parser.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp), args.hidden_size, args.num_layers,
                                max(2048, args.prompt_len + args.max_tokens + 8))
        engine = dict(dtype="float32", block_size=16, max_num_seqs=4,
                      max_num_batched_tokens=2048, enable_prefix_caching=False)
        transfer = {"kv_connector": "P2pShmConnector", "kv_port": port}
        alone = LLM(str(path), **engine)
        prefill = LLM(str(path), **engine, kv_transfer_config={**transfer,
                                                               "kv_role": "kv_producer"})
        decode = LLM(str(path), **engine, kv_transfer_config={**transfer,
                                                              "kv_role": "kv_consumer"})
        times = {"alone": [], "prefill": [], "decode": []}
        same = True
        for prompt in prompts:
            times["alone"].append(_timed(alone, prompt, _params(1))[0])
            t, first = _timed(prefill, prompt, _params(1, {"do_remote_decode": True}))
            times["prefill"].append(t)
            t, out = _timed(decode, prompt, _params(1, first.kv_transfer_params))
            times["decode"].append(t)
            assert out.num_cached_tokens == len(prompt) - 1
        for prompt in prompts[:4]:
            want = alone.generate(prompt, _params(args.max_tokens), use_tqdm=False)[0]
            first = prefill.generate(prompt, _params(1, {"do_remote_decode": True}),
                                     use_tqdm=False)[0]
            got = decode.generate(prompt, _params(args.max_tokens, first.kv_transfer_params),
                                  use_tqdm=False)[0]
            same &= want.outputs[0].token_ids == got.outputs[0].token_ids
    for name, values in times.items():
        print(f"{name:8s}: median {statistics.median(values) * 1e3:7.1f} ms over "
              f"{len(values)} prompts of {args.prompt_len} tokens")
    ratio = statistics.median(times["alone"]) / statistics.median(times["decode"])
    print(f"first token on the decode instance vs a prefill on one engine: {ratio:.1f}x less "
          f"time; greedy outputs of {args.max_tokens} tokens identical: {same}")


if __name__ == "__main__":
    main()
