"""Thread CPU time of a batch with the native MoE block on and off, alternated in one process
(docs/benchmarks.md, "Native MoE block"): a loaded host's descheduling does not count.

    python scripts/bench_moe_block_cpu_time.py deepseek-v2-lite-200m 32 128 2

Arguments: preset, requests, output tokens each (128 random prompt tokens each, greedy), and
repetitions per setting (after one warm-up). Prints the CPU and wall seconds of each run per
setting and whether the greedy tokens of both settings agree.
"""

from __future__ import annotations

import os
import random
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path
from pagedllm.platforms import current_platform


def main() -> None:
    preset, num_requests, output_len, reps = sys.argv[1], *map(int, sys.argv[2:5])
    llm = LLM(model=preset_path(preset, "float32"), dtype="float32", max_model_len=512, seed=0)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]}
               for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def run() -> tuple[float, float, list]:
        cpu, wall = time.thread_time(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return (time.thread_time() - cpu, time.perf_counter() - wall,
                [o.outputs[0].token_ids for o in outs])

    run()
    times: dict[str, list] = {"1": [], "0": []}
    tokens = {}
    for _ in range(reps):
        for switch in ("1", "0"):
            os.environ["PAGEDLLM_CPU_MOE_BLOCK"] = switch
            current_platform.configure_options()
            cpu, wall, tokens[switch] = run()
            times[switch].append((cpu, wall))
    for switch in ("1", "0"):
        print(f"{preset} {num_requests} x (128 -> {output_len}) PAGEDLLM_CPU_MOE_BLOCK="
              f"{switch}: CPU s {[round(c, 2) for c, _ in times[switch]]}, wall s "
              f"{[round(w, 2) for _, w in times[switch]]}")
    print(f"greedy tokens equal on/off: {tokens['1'] == tokens['0']}, load average "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
