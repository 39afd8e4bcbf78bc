"""Process CPU time per output token of speculative decoding against plain decoding at batch 1,
both engines in one process, request by request alternated (docs/benchmarks.md, "Verification
rows on Q4_1 GGUF"): on a shared machine the CPU a request costs moves much less with the load
than its wall-clock TPOT.

    PAGEDLLM_CPU_THREADS=1 OMP_NUM_THREADS=1 python scripts/bench_spec_cpu_time.py MODEL.gguf
        [--workload agent|chat] [--num-prompts 8] [--output-len 256] [--spec JSON]

Greedy, EOS honoured (at most --output-len tokens), the first request a warm-up; each request's
prompt is prefilled first (a one-token request), so the timed request finds it in the prefix
cache and its CPU is the decode's. Prints the CPU ms per output token of each engine (summed over
the timed requests), their ratio (plain / spec: > 1 = speculation costs less CPU per token),
the per-request median ratio and whether the greedy outputs agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.agent_workload import make_agent_workload
from pagedllm.benchmarks.chat_workload import make_chat_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--workload", choices=("agent", "chat"), default="agent")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--spec", default='{"method": "suffix", "num_speculative_tokens": 8}')
    args = parser.parse_args()
    spec = LLM(model=args.model, speculative_config=json.loads(args.spec), seed=0)
    plain = LLM(model=args.model, seed=0)
    make = make_agent_workload if args.workload == "agent" else make_chat_workload
    requests = make(spec.get_tokenizer(), args.num_prompts, args.output_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    cpu = {"spec": [], "plain": []}
    tokens = {"spec": [], "plain": []}
    for i, request in enumerate(requests):
        order = (("spec", spec), ("plain", plain)) if i % 2 == 0 else (("plain", plain),
                                                                        ("spec", spec))
        for name, llm in order:
            # The prompt's prefill first (one token), so that the timed run finds the prompt in
            # the prefix cache and measures the decode.
            llm.generate([{"prompt_token_ids": request.prompt_token_ids}],
                         SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            start = time.process_time()
            out = llm.generate([{"prompt_token_ids": request.prompt_token_ids}], params,
                               use_tqdm=False)[0].outputs[0].token_ids
            if i > 0:
                cpu[name].append(time.process_time() - start)
                tokens[name].append(list(out))
    n = sum(len(t) for t in tokens["plain"])
    per = {name: 1e3 * sum(cpu[name]) / n for name in cpu}
    pairs = [p / s for p, s in zip(cpu["plain"], cpu["spec"])]
    print(f"{args.workload}, {args.spec}, {len(pairs)} timed requests, {n} output tokens "
          f"({[len(t) for t in tokens['plain']]})")
    print(f"CPU ms per token: spec {per['spec']:.2f}, plain {per['plain']:.2f}; ratio "
          f"{per['plain'] / per['spec']:.2f}; per-request median {statistics.median(pairs):.2f} "
          f"({', '.join(f'{r:.2f}' for r in pairs)})")
    print(f"greedy outputs identical: {tokens['spec'] == tokens['plain']}; load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
