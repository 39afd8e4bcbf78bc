"""`pagedllm bench latency`'s runner: one engine's waves, the same waves without speculation
(`--compare no-spec`, one engine after the other or, with `--alternate`, side by side) and the
llama.cpp peer."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
from typing import Any

from pagedllm.benchmarks.cli import (_check_workload_seed, _finish, _run_dtype_name,
                                     _vocab_size, build_workload, check_llamacpp_peer,
                                     resolve_model)


def run_latency_command(args: argparse.Namespace) -> int:
    """Run the latency waves and the peers `--compare` asks for; print and save the results.
    Returns the exit status (`cli._finish`). Raises ValueError on flags that do not go
    together."""
    from pagedllm.benchmarks.report import print_result

    if args.batch_size < 1 or args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size and --num-iters must be >= 1, --num-iters-warmup >= 0")
    kwargs = resolve_model(args)
    if "no-spec" in args.compare and not kwargs.get("speculative_config"):
        raise ValueError("--compare no-spec needs --speculative-config")
    if args.llamacpp_spec != "none" and ("llamacpp" not in args.compare
                                         or args.batch_size != 1):
        raise ValueError("--llamacpp-spec needs --compare llamacpp and --batch-size 1")
    if args.alternate and ("no-spec" not in args.compare or args.profile):
        raise ValueError("--alternate needs --compare no-spec and does not take --profile")
    if args.no_ignore_eos and "llamacpp" in args.compare:
        raise ValueError("--no-ignore-eos does not apply to --compare llamacpp (its runs "
                         "generate exactly --output-len tokens)")
    check_llamacpp_peer(args, kwargs)
    model_path = kwargs["model"]
    alternation = None
    if args.alternate:
        result, plain, alternation, requests = _run_latency_alternating(args, kwargs)
    else:
        result, requests = _run_latency(args, kwargs)
    results, not_run = [result], []
    if "no-spec" in args.compare:
        if alternation is None:
            plain, _ = _run_latency(args, {**kwargs, "speculative_config": None}, requests)
        # > 1: speculation is faster (the plain engine's TPOT / the speculating one's).
        plain["tpot_speedup_of_spec"] = plain["tpot_ms_mean"] / result["tpot_ms_mean"]
        plain["e2e_speedup_of_spec"] = (plain["e2e_latency_ms_mean"]
                                        / result["e2e_latency_ms_mean"])
        plain.update(compare_greedy_outputs(result, plain))
        if alternation is not None:
            plain["alternation"] = alternation
        print_result({k: v for k, v in plain.items() if k != "output_token_ids"},
                     f"pagedllm latency without speculation (batch {args.batch_size})")
        if alternation is not None:
            print_alternation(alternation)
        results.append(plain)
    if "llamacpp" in args.compare:
        from pagedllm.benchmarks.llamacpp_baseline import run_llamacpp_latency

        gc.collect()
        try:
            if args.llamacpp_spec != "none":
                theirs = _run_llamacpp_spec(args, model_path, requests, result["dtype"])
            else:
                theirs = run_llamacpp_latency(model_path, requests, args.batch_size,
                                              result["dtype"], args.llamacpp_converter,
                                              args.num_iters_warmup,
                                              num_threads=args.llamacpp_threads)
        except RuntimeError as e:
            print(str(e))
            not_run.append("llamacpp")
        else:
            # > 1: our decode steps are faster (their TPOT / ours).
            theirs["tpot_speedup_vs_llamacpp"] = theirs["tpot_ms_mean"] / result["tpot_ms_mean"]
            theirs["ttft_speedup_vs_llamacpp"] = theirs["ttft_ms_mean"] / result["ttft_ms_mean"]
            theirs["e2e_speedup_vs_llamacpp"] = (theirs["e2e_latency_ms_mean"]
                                                 / result["e2e_latency_ms_mean"])
            print_result(theirs, f"llama.cpp latency (batch {args.batch_size})")
            results.append(theirs)
    return _finish(args, results, not_run)


def compare_greedy_outputs(spec: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """Whether two latency runs of the same waves gave the same tokens (greedy: speculation must
    not change them): `greedy_outputs_identical`, `num_requests_differing` and, for the first
    request that differs, its index and the first differing position."""
    a, b = spec["output_token_ids"], plain["output_token_ids"]
    differing = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    out: dict[str, Any] = {"greedy_outputs_identical": not differing and len(a) == len(b),
                           "num_requests_differing": len(differing)}
    if differing:
        x, y = a[differing[0]], b[differing[0]]
        pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        out["first_difference"] = {"request": differing[0], "position": pos}
    return out


def _run_llamacpp_spec(args: argparse.Namespace, model_path: str, requests,
                       dtype_name: str) -> dict[str, Any]:
    """llama.cpp's latency waves with speculative decoding (`--llamacpp-spec`), on the file
    `gguf_for` gives. Raises RuntimeError as `run_llamacpp_spec_latency`."""
    from pagedllm.benchmarks.llamacpp_baseline import gguf_for, llamacpp_unavailable_reason
    from pagedllm.benchmarks.llamacpp_spec import run_llamacpp_spec_latency

    reason = llamacpp_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    gguf = gguf_for(model_path, dtype_name, args.llamacpp_converter)
    return run_llamacpp_spec_latency(str(gguf), requests, args.llamacpp_spec,
                                     args.llamacpp_num_pred_tokens, args.llamacpp_max_ngram,
                                     args.num_iters_warmup, num_threads=args.llamacpp_threads)


def print_alternation(alternation: dict[str, Any]) -> None:
    """One line per wave pair of `run_latency_alternating`'s summary, then the median and
    spread of the TPOT ratios."""
    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}"

    print("wave pairs (alternating): wave, first, TPOT spec / plain ms, TPOT ratio, e2e ratio")
    for p in alternation["pairs"]:
        print(f"  {p['wave']:>3}  {p['first']:<5}  {p['spec_tpot_ms']:8.2f} / "
              f"{p['plain_tpot_ms']:8.2f}  {fmt(p['tpot_ratio'])}  {fmt(p['e2e_ratio'])}")
    print(f"TPOT ratio over {alternation['num_pairs']} pairs: median "
          f"{alternation['tpot_ratio_median']:.2f}, min {alternation['tpot_ratio_min']:.2f}, "
          f"max {alternation['tpot_ratio_max']:.2f}, IQR {alternation['tpot_ratio_iqr']:.2f}; "
          f"e2e ratio median {alternation['e2e_ratio_median']:.2f}")


def _latency_requests(args: argparse.Namespace, llm, model_path: str, requests=None):
    """`requests`, or (when None) the workload the flags ask for, built with `llm`'s
    tokenizer."""
    num_prompts = args.batch_size * (args.num_iters + args.num_iters_warmup)
    if requests is None and args.workload == "agent":
        from pagedllm.benchmarks.agent_workload import make_agent_workload

        requests = make_agent_workload(llm.get_tokenizer(), num_prompts, args.output_len,
                                       args.seed, ignore_eos=not args.no_ignore_eos)
    elif requests is None and args.workload == "chat":
        from pagedllm.benchmarks.chat_workload import make_chat_workload

        requests = make_chat_workload(llm.get_tokenizer(), num_prompts, args.output_len,
                                      args.seed)
        if args.no_ignore_eos:
            requests = [dataclasses.replace(r, ignore_eos=False) for r in requests]
    elif requests is None:
        requests = build_workload(args, _vocab_size(model_path), num_prompts)
        if args.no_ignore_eos:
            requests = [dataclasses.replace(r, ignore_eos=False) for r in requests]
    return requests


def _add_spec_stats(result: dict[str, Any], llm) -> None:
    spec = llm.get_stats().spec_decoding_stats
    if spec.num_drafts:
        result["spec_decoding"] = {
            "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "mean_accepted_length": spec.mean_accepted_length,
            "acceptance_rate_per_pos": spec.acceptance_rate_per_pos}


def _run_latency(args: argparse.Namespace, kwargs: dict[str, Any], requests=None):
    """One engine's latency run over `requests` (built from the workload flags when None) with
    the roofline figures; printed. Returns (result, requests)."""
    from pagedllm import LLM
    from pagedllm.benchmarks.latency import run_latency

    _check_workload_seed(args)
    llm = LLM(**kwargs)
    requests = _latency_requests(args, llm, kwargs["model"], requests)
    result = run_latency(llm, requests, args.batch_size, args.num_iters_warmup,
                         profile=args.profile, profile_steps=args.profile_steps)
    _add_spec_stats(result, llm)
    del llm
    gc.collect()
    _finish_latency_result(args, kwargs, result, requests)
    return result, requests


def _run_latency_alternating(args: argparse.Namespace, kwargs: dict[str, Any]):
    """`--compare no-spec --alternate`: the speculating engine (`kwargs`) and the plain one
    built side by side, the waves alternating between them (`run_latency_alternating`).
    Returns (spec result, plain result, alternation summary, requests); both results
    printed."""
    from pagedllm import LLM
    from pagedllm.benchmarks.latency import run_latency_alternating

    _check_workload_seed(args)
    spec_llm = LLM(**kwargs)
    requests = _latency_requests(args, spec_llm, kwargs["model"])
    plain_kwargs = {**kwargs, "speculative_config": None}
    plain_llm = LLM(**plain_kwargs)
    spec, plain, alternation = run_latency_alternating(spec_llm, plain_llm, requests,
                                                       args.batch_size, args.num_iters_warmup)
    _add_spec_stats(spec, spec_llm)
    _add_spec_stats(plain, plain_llm)
    del spec_llm, plain_llm
    gc.collect()
    _finish_latency_result(args, kwargs, spec, requests)
    _finish_latency_result(args, plain_kwargs, plain, requests, echo=False)
    return spec, plain, alternation, requests


def _finish_latency_result(args: argparse.Namespace, kwargs: dict[str, Any],
                           result: dict[str, Any], requests, echo: bool = True) -> None:
    """Add the run's settings and the roofline figures to `result`; print it when `echo`."""
    import torch

    from pagedllm.benchmarks.latency import (decode_bytes_per_token, measure_fma_peak,
                                             measure_memory_bandwidth, roofline)
    from pagedllm.benchmarks.report import print_result

    model_path = kwargs["model"]
    profile_rows = result.pop("profile_top_ops", None)
    result["model"] = model_path
    result["workload"] = args.workload
    result["ignore_eos"] = not args.no_ignore_eos
    result["speculative_config"] = kwargs.get("speculative_config")
    result["dtype"] = _run_dtype_name(kwargs["dtype"])
    run_dtype = getattr(torch, result["dtype"])
    if args.bandwidth_mib > 0 and not math.isnan(result["tpot_ms_mean"]):
        bandwidth = measure_memory_bandwidth(args.bandwidth_mib * 2**20)
        bytes_info = decode_bytes_per_token(model_path, run_dtype)
        timed = requests[args.batch_size * args.num_iters_warmup:]
        mean_ctx = sum(len(r.prompt_token_ids) + r.output_len / 2 for r in timed) / len(timed)
        result["memory_bandwidth"] = bandwidth
        result["fma_peak"] = measure_fma_peak()
        result["decode_bytes"] = bytes_info
        # NOTE(bench): the bound uses the faster probe, the bandwidth torch demonstrably reaches.
        result["roofline"] = roofline(bytes_info, max(bandwidth["copy_gbps"],
                                                      bandwidth["gemv_gbps"]),
                                      args.batch_size, mean_ctx, result["tpot_ms_mean"] / 1e3)
    token_ids = result.pop("output_token_ids")
    if echo:
        print_result(result, f"pagedllm latency (batch {args.batch_size})")
    result["output_token_ids"] = token_ids
    if profile_rows is not None:
        result["profile_top_ops"] = profile_rows
