"""Speculative decoding benchmark on a repetitive workload (issue #8).

Each prompt holds a passage of Shakespeare followed by its first words again, so a model that
continues the passage repeats text that is in its prompt: the case prompt lookup (n-gram) was
made for. Runs the same greedy workload without speculation, with the n-gram proposer and with
the shipped draft model, checks that the outputs are identical, and prints output tokens/s,
speed-up, acceptance rate and mean accepted length per drafted step.

    python scripts/bench_spec_decode.py [--num-prompts 8] [--max-tokens 96] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import time

from pagedllm import LLM, SamplingParams
from pagedllm.assets import DEFAULT_DRAFT_MODEL_NAME, DEFAULT_MODEL_NAME, model_path

PASSAGES = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n",
    "Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n"
    "The evil that men do lives after them;\nThe good is oft interred with their bones;\n",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
    "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n",
    "All the world's a stage,\nAnd all the men and women merely players;\n"
    "They have their exits and their entrances,\nAnd one man in his time plays many parts,\n",
]


def _prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        passage = PASSAGES[i % len(PASSAGES)]
        out.append(passage + passage + passage[: 20 + 5 * i])
    return out


def _run(model: str, prompts: list[str], params: SamplingParams, spec: dict | None):
    llm = LLM(model, speculative_config=spec, enable_prefix_caching=False)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = llm.get_stats().spec_decoding_stats
    return tokens, sum(map(len, tokens)) / elapsed, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    target, draft = model_path(DEFAULT_MODEL_NAME), model_path(DEFAULT_DRAFT_MODEL_NAME)
    prompts = _prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    base_tokens, base_tps, _ = _run(target, prompts, params, None)
    results = {"baseline": {"output_tokens_per_s": base_tps}}
    print(f"{'method':<12} {'tok/s':>8} {'speed-up':>9} {'accept':>7} {'mean len':>9} same")
    print(f"{'none':<12} {base_tps:8.1f} {1.0:9.2f} {'-':>7} {'-':>9} -")
    for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": args.k}),
                       ("draft_model", {"method": "draft_model", "model": draft,
                                        "num_speculative_tokens": args.k})):
        tokens, tps, stats = _run(target, prompts, params, spec)
        same = tokens == base_tokens
        results[name] = {"output_tokens_per_s": tps, "speedup": tps / base_tps,
                         "acceptance_rate": stats.acceptance_rate,
                         "mean_accepted_length": stats.mean_accepted_length,
                         "same_tokens": same}
        print(f"{name:<12} {tps:8.1f} {tps / base_tps:9.2f} {stats.acceptance_rate:7.2f} "
              f"{stats.mean_accepted_length:9.2f} {same}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
