"""`pagedllm bench eplb`: decode throughput and expert-load imbalance with EPLB off and on.

Builds a random-weight Mixtral into a temporary folder whose routers send about `hot_share` of
the (token, expert) pairs to `num_hot_experts` of the experts (the skew of a real MoE's popular
experts), then runs the same greedy decode workload twice over `ep_size` expert-parallel ranks
(mp executor): once with the static placement, once with EPLB (redundant experts, a short
window and interval). It reports each run's decode throughput, EPLB's imbalance (max / mean of
the EP ranks' loads, see docs/moe.md) before its first rebalance (the static placement) and
under its own placements, and the throughput ratio.

How the skew is made: every token embedding gets a shared component `c * u` (unit vector u), so
the residual stream of every token leans along u; the router rows of the hot experts get
`b * u`, which raises their logits for every token. `b` is found by bisection on one forward of
random tokens through transformers, so the measured share of the hot experts is `hot_share`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

_VOCAB_SIZE = 1024
_HEAD_SIZE = 32
# Length of the shared embedding component relative to a random embedding row's norm.
_EMBED_OFFSET_SCALE = 2.0


def add_eplb_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench eplb` on the `bench` sub-parsers."""
    p = sub.add_parser("eplb", help="decode throughput and expert-load imbalance of a skewed "
                                    "synthetic MoE over expert-parallel ranks, EPLB off and on")
    m = p.add_argument_group("synthetic model (random-weight Mixtral)")
    m.add_argument("--hidden-size", type=int, default=256,
                   help="hidden size of the synthetic MoE model (default 256)")
    m.add_argument("--intermediate-size", type=int, default=512, help="of each expert")
    m.add_argument("--num-layers", type=int, default=4,
                   help="decoder layers (default 4)")
    m.add_argument("--num-experts", type=int, default=8,
                   help="experts per layer (default 8)")
    m.add_argument("--num-hot-experts", type=int, default=2,
                   help="experts the skewed router favours (default 2)")
    m.add_argument("--hot-share", type=float, default=0.5,
                   help="fraction of the (token, expert) pairs routed to the hot experts")
    e = p.add_argument_group("engine")
    e.add_argument("--ep-size", type=int, default=2, help="expert-parallel (= TP) ranks, mp")
    e.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    e.add_argument("--num-redundant-experts", type=int, default=2,
                   help="extra expert replicas EPLB may place (default 2)")
    e.add_argument("--window-size", type=int, default=8, help="EPLB window, in steps")
    e.add_argument("--step-interval", type=int, default=8, help="steps between rebalances")
    w = p.add_argument_group("decode workload (seeded by --seed)")
    w.add_argument("--num-prompts", type=int, default=16, help="requests (default 16)")
    w.add_argument("--input-len", type=int, default=16,
                   help="prompt tokens per request (default 16)")
    w.add_argument("--output-len", type=int, default=64,
                   help="output tokens per request (default 64)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    p.add_argument("--output-json", default=None, help="save the results as JSON here")
    p.set_defaults(func=run_eplb_command)
    return p


def run_eplb_command(args: argparse.Namespace) -> int:
    """Build the model, run the workload without and with EPLB, print and return 0.

    Raises:
        ValueError: for a hot share outside (0, 1), more hot experts than experts, or sizes < 1.
    """
    from pagedllm.benchmarks.cli import _finish
    from pagedllm.benchmarks.report import print_result
    from pagedllm.benchmarks.workload import WorkloadSpec, make_workload

    _check_args(args)
    requests = make_workload(WorkloadSpec(num_prompts=args.num_prompts, vocab_size=_VOCAB_SIZE,
                                          input_len=args.input_len, output_len=args.output_len,
                                          seed=args.seed))
    with tempfile.TemporaryDirectory(prefix="pagedllm-eplb-") as tmp:
        model_path, measured_share = build_skewed_moe(
            Path(tmp) / "moe", args.hidden_size, args.intermediate_size, args.num_layers,
            args.num_experts, args.num_hot_experts, args.hot_share, args.seed)
        setup = {"model": "random-weight MixtralForCausalLM", "hidden_size": args.hidden_size,
                 "intermediate_size": args.intermediate_size, "num_layers": args.num_layers,
                 "num_experts": args.num_experts, "top_k": 2, "hot_experts": args.num_hot_experts,
                 "hot_share_measured": measured_share, "ep_size": args.ep_size,
                 "num_requests": len(requests), "input_len": args.input_len,
                 "output_len": args.output_len}
        print_result(setup, "eplb bench set-up")
        engine_args = dict(dtype=args.dtype, tensor_parallel_size=args.ep_size,
                           distributed_executor_backend="mp", enable_expert_parallel=True,
                           kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=False)
        off = run_decode(str(model_path), requests, engine_args)
        print_result(off, "EPLB off (static placement)")
        eplb_config = {"window_size": args.window_size, "step_interval": args.step_interval,
                       "num_redundant_experts": args.num_redundant_experts}
        on = run_decode(str(model_path), requests,
                        {**engine_args, "enable_eplb": True, "eplb_config": eplb_config})
        print_result(on, "EPLB on")
    comparison = {"decode_tokens_per_s_ratio_on_off":
                  on["decode_tokens_per_s"] / off["decode_tokens_per_s"],
                  "same_greedy_tokens": off.pop("token_ids") == on.pop("token_ids")}
    print_result(comparison, "EPLB on / off")
    off["backend"], on["backend"] = "eplb_off", "eplb_on"
    off["setup"] = on["setup"] = setup
    on["comparison"] = comparison
    return _finish(args, [off, on])


def _check_args(args: argparse.Namespace) -> None:
    if args.hidden_size % (_HEAD_SIZE * args.ep_size):
        raise ValueError(f"--hidden-size must be a multiple of {_HEAD_SIZE} x --ep-size (heads "
                         f"of {_HEAD_SIZE}, split over the ranks), got {args.hidden_size}")
    if not 0.0 < args.hot_share < 1.0:
        raise ValueError(f"--hot-share must be in (0, 1), got {args.hot_share}")
    if not 1 <= args.num_hot_experts < args.num_experts:
        raise ValueError(f"--num-hot-experts must be in [1, --num-experts), got "
                         f"{args.num_hot_experts}")
    for name in ("hidden_size", "intermediate_size", "num_layers", "ep_size", "num_prompts",
                 "input_len", "output_len", "window_size", "step_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def run_decode(model_path: str, requests, engine_args: dict[str, Any]) -> dict[str, Any]:
    """Step an engine through `requests` (all added at once; greedy, exact lengths) and time
    the decode phase: from the first step after which every request has a token to the end.
    No warm-up run: the engine's start-up profile run has already run the model, and the first
    EPLB window must see this workload only (its `before` is the static placement's imbalance).

    Returns decode_tokens_per_s (tokens sampled in the decode phase / its seconds), prefill_s,
    the mean seconds of a decode step without a rebalance and (EPLB) of a step with one, the
    EPLB figures when EPLB ran (rebalances; mean over layers of the imbalance before the
    first rebalance = static placement, under EPLB's own placements = `before` of the later
    rebalances, and `after` of the last as the policy predicted it) and token_ids.
    """
    import numpy as np

    from pagedllm.benchmarks.workload import sampling_params_for
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(model_path, **engine_args)
    try:
        for i, r in enumerate(requests):
            engine.add_request(f"b{i}", {"prompt_token_ids": r.prompt_token_ids},
                               sampling_params_for(r))
        counts = {f"b{i}": 0 for i in range(len(requests))}
        token_ids: dict[str, list[int]] = {}
        rebalances = {}
        start = time.perf_counter()
        decode_start, decode_tokens, num_steps = None, 0, 0
        rebalance_step_s: list[float] = []
        other_decode_step_s: list[float] = []
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            step_s = time.perf_counter() - step_start
            num_steps += 1
            for out in outputs:
                new = len(out.outputs[0].token_ids)
                if decode_start is not None:
                    decode_tokens += new - counts[out.request_id]
                counts[out.request_id] = new
                if out.finished:
                    token_ids[out.request_id] = list(out.outputs[0].token_ids)
            stats = engine.get_eplb_stats()
            if stats is not None and stats.num_rebalances not in rebalances:
                rebalances[stats.num_rebalances] = stats
                rebalance_step_s.append(step_s)
            elif decode_start is not None:
                other_decode_step_s.append(step_s)
            if decode_start is None and all(counts.values()):
                decode_start = time.perf_counter()
        end = time.perf_counter()
    finally:
        engine.engine_core.shutdown()
    result: dict[str, Any] = {
        "num_steps": num_steps,
        "prefill_s": (decode_start or end) - start,
        "decode_s": end - (decode_start or end),
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / max(end - (decode_start or end), 1e-9),
        "decode_step_s_mean": float(np.mean(other_decode_step_s)) if other_decode_step_s
        else float("nan"),
    }
    if rebalances:
        ordered = [rebalances[k] for k in sorted(rebalances)]
        result["num_rebalances"] = ordered[-1].num_rebalances
        result["rebalance_step_s_mean"] = float(np.mean(rebalance_step_s))
        result["imbalance_static_placement"] = float(np.mean(ordered[0].imbalance_before))
        if len(ordered) > 1:
            result["imbalance_under_eplb"] = float(np.mean(
                [np.mean(s.imbalance_before) for s in ordered[1:]]))
        result["imbalance_after_last_rebalance_predicted"] = float(
            np.mean(ordered[-1].imbalance_after))
    result["token_ids"] = [token_ids[f"b{i}"] for i in range(len(requests))]
    return result


def build_skewed_moe(out_dir: Path, hidden_size: int, intermediate_size: int, num_layers: int,
                     num_experts: int = 8, num_hot_experts: int = 2, hot_share: float = 0.5,
                     seed: int = 0) -> tuple[Path, float]:
    """Save a random-weight `MixtralForCausalLM` (top-2, fp32, heads of 32) whose routers send about
    `hot_share` of the (token, expert) pairs to experts 0 .. num_hot_experts - 1.

    Returns (out_dir, the share measured on 256 random tokens through transformers).

    Raises:
        ValueError: when no router bias reaches `hot_share` (the bisection's upper end).
    """
    import torch
    from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

    from pagedllm.benchmarks.presets import write_synthetic_tokenizer

    out_dir.mkdir(parents=True)
    write_synthetic_tokenizer(out_dir, _VOCAB_SIZE)
    num_heads = hidden_size // _HEAD_SIZE
    config = MixtralConfig(vocab_size=_VOCAB_SIZE, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                           num_attention_heads=num_heads, num_key_value_heads=num_heads,
                           num_local_experts=num_experts, num_experts_per_tok=2,
                           max_position_embeddings=4096, tie_word_embeddings=False,
                           bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config.architectures = ["MixtralForCausalLM"]
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(hidden_size, generator=generator)
    direction /= direction.norm()
    routers = [m for name, m in model.named_modules() if name.endswith(".gate")
               and getattr(m, "weight", None) is not None
               and tuple(m.weight.shape) == (num_experts, hidden_size)]
    if len(routers) != num_layers:
        raise RuntimeError(f"found {len(routers)} routers in transformers' Mixtral, expected "
                           f"{num_layers}")
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed += _EMBED_OFFSET_SCALE * embed.norm(dim=1).mean() * direction
        base = [r.weight.clone() for r in routers]
        tokens = torch.randint(3, _VOCAB_SIZE, (1, 256), generator=generator)

        def share(bias: float) -> float:
            for r, w in zip(routers, base):
                r.weight.copy_(w)
                r.weight[:num_hot_experts] += bias * direction
            return _hot_share(model, routers, tokens, num_hot_experts)

        low, high = -50.0, 50.0
        if not share(low) <= hot_share <= share(high):
            raise ValueError(f"no router bias in [{low}, {high}] gives a hot share of {hot_share}")
        for _ in range(20):
            mid = (low + high) / 2
            if share(mid) < hot_share:
                low = mid
            else:
                high = mid
        measured = share((low + high) / 2)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model.save_pretrained(out_dir)
    return out_dir, measured


def _hot_share(model, routers, tokens, num_hot_experts: int) -> float:
    """Fraction of the top-2 (token, expert) pairs of all routers that pick a hot expert."""
    import torch

    picked: list[torch.Tensor] = []

    def hook(module, inputs):
        logits = torch.nn.functional.linear(inputs[0].reshape(-1, module.weight.shape[1]),
                                            module.weight)
        picked.append(torch.topk(logits, 2, dim=-1).indices)

    handles = [r.register_forward_pre_hook(hook) for r in routers]
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    ids = torch.cat([p.flatten() for p in picked])
    return float((ids < num_hot_experts).float().mean())
