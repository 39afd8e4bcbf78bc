"""Speculative decoding benchmark on a repetitive workload (issue #8).

Each prompt holds a passage of Shakespeare followed by its first words again, so a model that
continues the passage repeats text that is in its prompt: the case prompt lookup (n-gram) was
made for. Runs the same greedy workload without speculation, with the n-gram proposer and with
the shipped draft model, checks that the outputs are identical, and prints output tokens/s,
speed-up, acceptance rate and mean accepted length per drafted step.

    python scripts/bench_spec_decode.py [--num-prompts 8] [--max-tokens 96] [--k 4]

`--compare-async` runs every method with synchronous steps and with `async_scheduling` (step N+1
scheduled with placeholder drafts before step N's output is processed), alternating the two
`--repeats` times, and prints the median wall time per model step and output tokens/s of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def _run(model: str, prompts: list[str], params: SamplingParams, spec: dict | None,
         async_scheduling: bool | None = None, step_times: list[float] | None = None):
    """Tokens, output tokens/s and spec-decode stats of one timed run; with `step_times`, the
    run's wall time per model step (executor call) is appended to it."""
    # (Single steps where the sync/async comparison asks: the plain engine's CPU default runs
    # multi-step rounds, which async scheduling and speculation replace.)
    llm = LLM(model, speculative_config=spec, enable_prefix_caching=False,
              async_scheduling=async_scheduling,
              num_scheduler_steps=None if async_scheduling is None else 1)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    executor = llm.llm_engine.engine_core.executor
    execute, num_steps = executor.execute_model, [0]

    def counted(*args, **kwargs):
        num_steps[0] += 1
        return execute(*args, **kwargs)

    executor.execute_model = counted
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if step_times is not None:
        step_times.append(elapsed / num_steps[0])
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = llm.get_stats().spec_decoding_stats
    return tokens, sum(map(len, tokens)) / elapsed, stats


def _compare_async(target: str, methods: list[tuple[str, dict | None]], prompts: list[str],
                   params: SamplingParams, repeats: int) -> dict:
    """Each method with synchronous and asynchronous steps, alternated `repeats` times: median
    ms per model step and output tokens/s, and whether the tokens were the same."""
    print(f"{'method':<12} {'ms/step sync':>13} {'ms/step async':>14} {'tok/s sync':>11} "
          f"{'tok/s async':>12} same")
    results = {}
    for name, spec in methods:
        steps: dict[bool, list[float]] = {False: [], True: []}
        tps: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list] = {}
        for _ in range(repeats):
            for mode in (False, True):
                tokens[mode], rate, _ = _run(target, prompts, params, spec, mode, steps[mode])
                tps[mode].append(rate)
        med = {m: (1e3 * statistics.median(steps[m]), statistics.median(tps[m]))
               for m in (False, True)}
        same = tokens[False] == tokens[True]
        results[name] = {"ms_per_step": {"sync": med[False][0], "async": med[True][0]},
                         "output_tokens_per_s": {"sync": med[False][1], "async": med[True][1]},
                         "same_tokens": same}
        print(f"{name:<12} {med[False][0]:13.2f} {med[True][0]:14.2f} {med[False][1]:11.1f} "
              f"{med[True][1]:12.1f} {same}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--compare-async", action="store_true",
                        help="each method with synchronous and with asynchronous scheduling")
    parser.add_argument("--repeats", type=int, default=3, help="paired runs (--compare-async)")
    args = parser.parse_args()
    target, draft = model_path(DEFAULT_MODEL_NAME), model_path(DEFAULT_DRAFT_MODEL_NAME)
    prompts = _prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.compare_async:
        k = args.k
        results = _compare_async(target, [
            ("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": k}),
            ("suffix", {"method": "suffix", "num_speculative_tokens": k}),
            ("draft_model", {"method": "draft_model", "model": draft,
                             "num_speculative_tokens": k})], prompts, params, args.repeats)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)
        return
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
