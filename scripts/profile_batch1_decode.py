"""Where a batch-1 decode token's time goes, for a bench preset (docs/benchmarks.md, "Batch-1
decode of the 200M presets").

    python scripts/profile_batch1_decode.py deepseek-v2-lite-200m [--tokens 128] [--ops]

One request of 128 random prompt tokens, greedy, `--tokens` output tokens, one warm-up run
first. Times are the engine thread's CPU time (`time.thread_time`), not wall time, so that a
loaded host's descheduling does not count (its cache and memory-bandwidth contention still
does). Each module's *exclusive* time (its forward minus its child modules') is summed per
module class; the LM head (`compute_logits`) and the rest of the step (runner, sampler, engine)
are timed apart. Hooks cost about a microsecond per module call, so the per-class figures add
up to a little more than the token's time without them (printed first, from an unhooked run).

`--ab N` instead alternates the native attention / mixer blocks (docs/mla.md,
docs/hybrid_models.md) on and off in one process, N rounds of one run each, and prints each
run's CPU and wall ms per token and the medians: a same-process A/B that a loaded host's
process-to-process swings do not enter.

`--ops` instead counts the ATen operators dispatched per decode token (a `TorchDispatchMode`
over a 33-token and a 1-token run, their difference / 32): a load-independent measure of the
per-step dispatch work.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.presets import preset_path


def _generate(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Thread CPU seconds of one greedy request of `tokens` output tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.thread_time()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.thread_time() - start


def count_ops(llm: LLM, prompt: list[int]) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[str(func)] += 1
            return func(*args, **(kwargs or {}))

    def run(tokens: int) -> collections.Counter:
        counts.clear()
        with Count():
            _generate(llm, prompt, tokens)
        return collections.Counter(counts)

    one, many = run(1), run(33)
    per_token = {k: (many[k] - one[k]) / 32 for k in many}
    print(f"ATen ops per decode token: {sum(per_token.values()):.1f}")
    for name, n in sorted(per_token.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {name:34s} {n:6.1f}")


def profile_time(llm: LLM, prompt: list[int], tokens: int) -> None:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    plain = min(_generate(llm, prompt, tokens) for _ in range(3))
    print(f"CPU ms per output token (prefill included), no hooks: {plain / tokens * 1e3:.2f}")
    exclusive: collections.defaultdict[str, float] = collections.defaultdict(float)
    stack: list[list[float]] = []   # [start, children's time]

    def pre(module, args):
        stack.append([time.thread_time(), 0.0])

    def post(module, args, out):
        start, children = stack.pop()
        elapsed = time.thread_time() - start
        exclusive[type(module).__name__] += elapsed - children
        if stack:
            stack[-1][1] += elapsed

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    compute_logits = model.compute_logits

    def timed_logits(*args, **kwargs):
        start = time.thread_time()
        try:
            return compute_logits(*args, **kwargs)
        finally:
            exclusive["LM head (compute_logits)"] += time.thread_time() - start

    model.compute_logits = timed_logits
    try:
        exclusive.clear()
        total = _generate(llm, prompt, tokens)
    finally:
        for h in handles:
            h.remove()
        del model.compute_logits
    exclusive["(runner, sampler, engine: the rest)"] = total - sum(exclusive.values())
    print(f"with hooks: {total / tokens * 1e3:.2f} ms per token; exclusive CPU ms per token:")
    for name, t in sorted(exclusive.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {t / tokens * 1e3:7.2f}  {t / total:6.1%}")


def native_ab(llm: LLM, prompt: list[int], tokens: int, rounds: int, what: str) -> None:
    """Alternate runs with the layers' native blocks (`what` "blocks"), the whole-stack
    call ("stack": native/hybrid_stack.py, against its per-half path) or the multi-step
    rounds' native decode loop ("loop": native/decode_loop.py) attached and detached."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    model = runner.model
    if what == "loop":   # the multi-step rounds' native loop (decided at the first round)
        slots = [(runner.multi_step, "native_loop", runner.multi_step.native_loop)]
    else:
        names = ("native_attention", "native_mixer") if what == "blocks" else ("layer_stack",)
        slots = [(m, name, getattr(m, name)) for m in model.modules()
                 for name in names if getattr(m, name, None) is not None]
    print(f"{len(slots)} native {what} attached")
    times: dict[str, list[tuple[float, float]]] = {"native": [], "module": []}
    for _ in range(rounds):
        for mode in ("native", "module"):
            for m, name, block in slots:
                setattr(m, name, block if mode == "native" else None)
            wall = time.perf_counter()
            cpu = _generate(llm, prompt, tokens)
            wall = time.perf_counter() - wall
            times[mode].append((cpu / tokens * 1e3, wall / tokens * 1e3))
            print(f"  {mode:7s} CPU {times[mode][-1][0]:6.2f} ms/token, wall "
                  f"{times[mode][-1][1]:6.2f} ms/token, load {os.getloadavg()[0]:.1f}")
    for mode, runs in times.items():
        cpu = sorted(r[0] for r in runs)[len(runs) // 2]
        wall = sorted(r[1] for r in runs)[len(runs) // 2]
        print(f"median {mode:7s} CPU {cpu:6.2f} ms/token, wall {wall:6.2f} ms/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ops", action="store_true", help="count ATen ops per decode token")
    parser.add_argument("--ab", type=int, default=0, metavar="N",
                        help="N rounds of native blocks on / off in this process")
    parser.add_argument("--ab-what", choices=("blocks", "stack", "loop"), default="blocks",
                        help="what --ab switches: the layers' native halves, the "
                             "whole-stack call (against the halves), or the native decode "
                             "loop of multi-step rounds (against step-by-step rounds)")
    args = parser.parse_args()
    llm = LLM(model=preset_path(args.preset, "float32"), dtype="float32", max_model_len=512,
              seed=0)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(128)]
    _generate(llm, prompt, args.tokens)   # warm-up
    if args.ops:
        count_ops(llm, prompt)
    elif args.ab:
        native_ab(llm, prompt, args.tokens, args.ab, args.ab_what)
    else:
        profile_time(llm, prompt, args.tokens)
    print(f"load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
