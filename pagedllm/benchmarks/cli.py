"""`pagedllm bench {throughput,latency,gemm,perplexity,serve,soak,eplb,images}`: flags, model
resolution and the runners.

Wire into the top-level CLI with `add_bench_parser(subparsers)`; each sub-command sets
`args.func`, which returns the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from pagedllm.engine.arg_utils import (add_engine_args, bounded_float, bounded_int,
                                       engine_kwargs_from_args)

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16",
                  "half": "float16"}


def _add_llamacpp_threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llamacpp-threads", type=bounded_int(1), default=None, metavar="N",
                        help="llama.cpp's n_threads (default: the machine's CPU count); set it "
                             "to the engine's thread count for a same-threads comparison")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` with the sub-commands `throughput`, `latency`, `gemm`, `perplexity`,
    `serve`, `soak`, `eplb` and `images`."""
    bench = subparsers.add_parser("bench", help="benchmark the engine (offline or a server)")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = sub.add_parser("throughput", help="offline throughput of the whole workload at once")
    add_engine_args(tp)
    _add_model_args(tp)
    _add_workload_args(tp, num_prompts=True)
    tp.add_argument("--compare", action="append", choices=["hf", "llamacpp"], default=[],
                    help="also run the workload through HF transformers / llama.cpp (repeatable)")
    # (Sizes with a default are refused below their least meaningful value by the parser:
    # code that reads them as `value or default` would take a 0 as the default silently.)
    tp.add_argument("--hf-batch-size", type=bounded_int(1), default=None, metavar="N",
                    help="static batch size of the HF baseline (default min(num_prompts, 32))")
    tp.add_argument("--llamacpp-batch-size", type=bounded_int(1), default=None, metavar="N",
                    help="sequences llama.cpp decodes together (default min(num_prompts, 64))")
    _add_llamacpp_threads_arg(tp)
    tp.add_argument("--co-tenants", type=bounded_int(1), default=1, metavar="N",
                    help="run one copy alone, then N copies at once, and report each copy's "
                         "figures, their sum and sum / alone (a shared machine)")
    tp.add_argument("--busy-co-tenants", type=bounded_int(0), default=0, metavar="K",
                    help="K busy single-threaded processes beside the copies (alone first, then "
                         "the copies, or one copy without --co-tenants, beside them)")
    tp.add_argument("--co-tenant-barrier", default=None, help=argparse.SUPPRESS)
    tp.add_argument("--num-loras", type=bounded_int(1), default=None, metavar="N",
                    help="also run the workload under N random LoRA adapters of --lora-rank "
                         "on every linear layer (request i under adapter i mod N) and report "
                         "it against the base model; with --compare hf, HF + peft serves the "
                         "same requests one adapter at a time (docs/lora.md)")
    tp.add_argument("--lora-rank", type=bounded_int(1), default=16, metavar="R",
                    help="rank of the --num-loras adapters (default 16)")
    tp.add_argument("--lora-rounds", type=bounded_int(1), default=1, metavar="K",
                    help="with --num-loras: alternate the base and the adapter runs K times "
                         "in the one engine and report each round's ratio and their median "
                         "(drift of a shared machine then hits both sides; default 1)")
    _add_output_args(tp)
    tp.set_defaults(func=run_throughput_command)

    lat = sub.add_parser("latency", help="TTFT/TPOT percentiles by stepping the engine")
    add_engine_args(lat)
    _add_model_args(lat)
    _add_workload_args(lat, num_prompts=False)
    lat.add_argument("--batch-size", type=int, default=1, help="requests per wave (default 1)")
    lat.add_argument("--num-iters", type=int, default=3, help="timed waves (default 3)")
    lat.add_argument("--num-iters-warmup", type=int, default=1, help="untimed waves (default 1)")
    lat.add_argument("--bandwidth-mib", type=bounded_int(0), default=256,
                     help="buffer size of the memory-bandwidth probe (0 = skip it)")
    lat.add_argument("--profile", action="store_true",
                     help="torch.profiler over a few decode steps; print the top ops")
    lat.add_argument("--profile-steps", type=bounded_int(1), default=8,
                     help="decode steps --profile records (default 8)")
    lat.add_argument("--compare", action="append", choices=["llamacpp", "no-spec"], default=[],
                     help="also run the same waves through llama.cpp (same GGUF file), or "
                          "(no-spec) through the engine without --speculative-config")
    lat.add_argument("--alternate", action="store_true",
                     help="with --compare no-spec: build both engines at once and alternate "
                          "the waves between them (spec, plain, then plain, spec, ...); "
                          "reports each wave pair's TPOT ratio and their median and spread, "
                          "which a load change on a shared machine moves far less than the "
                          "ratio of two runs one after the other (default: the plain run "
                          "after the whole speculative run)")
    _add_llamacpp_threads_arg(lat)
    lat.add_argument("--llamacpp-spec", choices=["none", "prompt-lookup"], default="none",
                     help="with --compare llamacpp: llama.cpp with speculative decoding, "
                          "prompt-lookup = llama-cpp-python's LlamaPromptLookupDecoding "
                          "(greedy, --batch-size 1; default none)")
    lat.add_argument("--llamacpp-num-pred-tokens", type=bounded_int(1), default=10, metavar="N",
                     help="prompt lookup's drafts per step (default 10, llama-cpp-python's)")
    lat.add_argument("--llamacpp-max-ngram", type=bounded_int(1), default=2, metavar="N",
                     help="prompt lookup's longest n-gram matched (default 2, "
                          "llama-cpp-python's)")
    lat.add_argument("--workload", choices=["random", "agent", "chat"], default="random",
                     help="random token ids (default); agent: code edits and JSON rewrites "
                          "whose prompts hold text the answer repeats; chat: everyday "
                          "questions through the chat template (--input-len ignored)")
    lat.add_argument("--no-ignore-eos", action="store_true",
                     help="end each request at the model's EOS / stop tokens (at most "
                          "--output-len tokens), as a real client's request does (vLLM's "
                          "ignore_eos=False); TPOT and e2e are then over the tokens generated. "
                          "Default: EOS ignored, exactly --output-len tokens")
    _add_output_args(lat)
    lat.set_defaults(func=run_latency_command)

    gemm = sub.add_parser("gemm", help="GFLOP/s of the CPU linear kernels (dot-product, packed "
                                       "GEMM) and torch's GEMM, against the FMA peak")
    gemm.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                      help="weight and activation dtype (default bfloat16)")
    gemm.add_argument("--rows", default="1,32,64,512",
                      help="comma-separated row counts M (default 1,32,64,512)")
    gemm.add_argument("--shapes", default="768x768,2048x768,768x2048,32000x768",
                      help="comma-separated weight shapes NxK (default: llama-134m's linears "
                           "and LM head)")
    _add_output_args(gemm)
    gemm.set_defaults(func=run_gemm_command)

    ppl = sub.add_parser("perplexity", help="perplexity of the model over a text (prompt "
                                            "logprobs over windows of max_model_len tokens)")
    add_engine_args(ppl)
    _add_model_args(ppl)
    ppl.add_argument("--input-file", default=None,
                     help="UTF-8 text to score (default: a built-in English passage)")
    ppl.add_argument("--window", type=bounded_int(2), default=None, metavar="N",
                     help="tokens per window (default and at most --max-model-len)")
    ppl.add_argument("--max-windows", type=bounded_int(1), default=None, metavar="N",
                     help="score only the first N windows (default: all)")
    ppl.add_argument("--compare", action="append", choices=["llamacpp"], default=[],
                     help="also score the same windows with llama.cpp on the same GGUF file")
    _add_output_args(ppl)
    ppl.set_defaults(func=run_perplexity_command)

    srv = sub.add_parser("serve", help="drive a running OpenAI-compatible server")
    srv.add_argument("--base-url", type=_http_url, default="http://127.0.0.1:8000",
                     help="the server's address (default http://127.0.0.1:8000)")
    srv.add_argument("--model", default=None,
                     help="model name sent in requests (default: the server's first model)")
    srv.add_argument("--api-key", default=None,
                     help="sent as `Authorization: Bearer KEY`")
    srv.add_argument("--vocab-size", type=bounded_int(2), default=None, metavar="N",
                     help="vocabulary for random prompts (default: from --preset, or the "
                          "config.json of the server's model root)")
    srv.add_argument("--preset", default=None, help="take the vocabulary size from this preset")
    srv.add_argument("--request-rate", type=_request_rate, default=math.inf,
                     help="Poisson arrival rate in requests/s (default inf: all at once)")
    srv.add_argument("--max-concurrency", type=bounded_int(1), default=None, metavar="N",
                     help="most requests in flight at once (default: no limit)")
    srv.add_argument("--seed", type=bounded_int(0), default=0,
                     help="seed of the random prompts and arrival times (default 0)")
    _add_workload_args(srv, num_prompts=True)
    _add_output_args(srv)
    srv.set_defaults(func=run_serve_command)
    _add_soak_parser(sub)
    from pagedllm.benchmarks.eplb import add_eplb_parser
    add_eplb_parser(sub)
    from pagedllm.benchmarks.images import add_images_parser
    add_images_parser(sub)
    return bench


def _add_soak_parser(sub: argparse._SubParsersAction) -> None:
    soak = sub.add_parser("soak", help="robustness soak of the OpenAI server: valid, invalid and "
                                       "disconnected requests; exits 1 naming what failed")
    target = soak.add_argument_group("target (default: start `pagedllm serve` on a free port)")
    target.add_argument("--url", default=None,
                        help="soak this running server instead (loopback addresses only)")
    target.add_argument("--api-key", default=None,
                        help="sent as `Authorization: Bearer KEY` (and required by a server the "
                             "soak starts)")
    target.add_argument("--model", default=None,
                        help="checkpoint of the started server (default: the shipped model); "
                             "with --url, the model name sent (default: the server's first)")
    target.add_argument("--vocab-size", type=bounded_int(2), default=None, metavar="N",
                        help="with --url: the model's vocabulary (default: from the checkpoint "
                             "that /v1/models names)")
    target.add_argument("--dtype", default="float32", help="of the started server")
    target.add_argument("--kv-cache-memory-bytes", type=bounded_int(1), default=2 * 2**20,
                        help="of the started server: small, to force preemption (default 2 MiB)")
    target.add_argument("--max-num-seqs", type=bounded_int(1), default=None, metavar="N",
                        help="of the started server (default: the server's)")
    target.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                        help="extra flag for the started server, e.g. --serve-arg=--no-enable-"
                             "prefix-caching (repeatable)")
    load = soak.add_argument_group("load and limits")
    load.add_argument("--num-requests", type=int, default=2000,
                      help="requests the soak sends (default 2000)")
    load.add_argument("--concurrency", type=int, default=64,
                      help="requests in flight at once (default 64)")
    load.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    load.add_argument("--request-timeout-s", type=float, default=120.0,
                      help="seconds before a request counts as hung (default 120)")
    load.add_argument("--max-duration-s", type=float, default=1800.0,
                      help="time limit of the whole run, server start-up included")
    load.add_argument("--idle-timeout-s", type=float, default=60.0,
                      help="how long the server may take to report idle gauges after the run")
    load.add_argument("--rss-drift-limit", type=bounded_float(0), default=0.10,
                      help="largest RSS growth from after the warm-up to the end (0.10 = 10%%)")
    load.add_argument("--server-rss-limit-mib", type=bounded_int(1), default=4096,
                      help="kill a started server whose RSS passes this (a runaway request)")
    load.add_argument("--skip", action="append", default=[], metavar="TEXT",
                      help="leave out the invalid cases and disconnect modes whose label "
                           "contains TEXT, e.g. 'n=10**9' or 'mid_stream' (repeatable)")
    _add_output_args(soak)
    soak.set_defaults(func=run_soak_command)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("preset models")
    from pagedllm.benchmarks.presets import PRESETS
    g.add_argument("--preset", default=None,
                   help=f"random-weight model by name ({', '.join(PRESETS)}); wins over --model")
    g.add_argument("--preset-dir", default=None,
                   help="preset cache (default $PAGEDLLM_PRESET_DIR or ~/.cache/pagedllm/presets)")
    g.add_argument("--gguf-type", default=None, metavar="TYPE",
                   help="with --preset: benchmark the preset converted to a GGUF file of this "
                        "llama.cpp type (f32, bf16, q8_0, q4_0, q4_1, q4_k_m, q6_k, ...; needs "
                        "llama-cpp-python and its converter), the file --compare llamacpp runs")
    g.add_argument("--llamacpp-converter", default=None,
                   help="path of llama.cpp's convert_hf_to_gguf.py")


def _add_workload_args(p: argparse.ArgumentParser, num_prompts: bool) -> None:
    g = p.add_argument_group("workload (seeded by --seed)")
    if num_prompts:
        g.add_argument("--num-prompts", type=int, default=32,
                       help="requests in the workload (default 32)")
    g.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens per request (default 128)")
    g.add_argument("--output-len", type=int, default=128,
                   help="output tokens per request (default 128)")
    g.add_argument("--random-input-len", default=None, metavar="LOW:HIGH",
                   help="uniform prompt lengths in [LOW, HIGH] (overrides --input-len)")
    g.add_argument("--random-output-len", default=None, metavar="LOW:HIGH",
                   help="uniform output lengths in [LOW, HIGH] (overrides --output-len)")
    g.add_argument("--token-low", type=bounded_int(0), default=None,
                   help="smallest prompt token id (default 300, skipping special/byte tokens)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-json", default=None, help="save the results as JSON here")


# ------------------------------------------------------------------ helpers
def dtype_name(dtype: str | None) -> str:
    name = str(dtype or "auto").replace("torch.", "")
    return _DTYPE_ALIASES.get(name, name)


def resolve_model(args: argparse.Namespace) -> dict[str, Any]:
    """Engine kwargs with `model` set: the preset's folder when --preset is given (its GGUF
    file with --gguf-type)."""
    if getattr(args, "preset", None):
        from pagedllm.benchmarks.presets import preset_path

        path = preset_path(args.preset, dtype_name(args.dtype), args.preset_dir)
        if getattr(args, "gguf_type", None):
            from pagedllm.benchmarks.llamacpp_baseline import preset_gguf

            try:
                path = str(preset_gguf(path, args.gguf_type, args.llamacpp_converter))
            except RuntimeError as e:   # llama.cpp or its converter missing, a failed tool
                raise ValueError(f"--gguf-type {args.gguf_type}: {e}") from e
        args = argparse.Namespace(**{**vars(args), "model": path})
    elif getattr(args, "gguf_type", None):
        raise ValueError("--gguf-type needs --preset (a --model .gguf file is run as it is)")
    kwargs = engine_kwargs_from_args(args)
    kwargs["dtype"] = dtype_name(kwargs["dtype"])
    return kwargs


def check_llamacpp_peer(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """With `--compare llamacpp`, refuse before the engine runs when llama.cpp could not
    (ValueError from `llamacpp_baseline.check_llamacpp_ready`)."""
    if "llamacpp" in args.compare:
        from pagedllm.benchmarks.llamacpp_baseline import check_llamacpp_ready

        check_llamacpp_ready(kwargs["model"], _run_dtype_name(kwargs["dtype"]),
                             args.llamacpp_converter)


def _check_workload_seed(args: argparse.Namespace) -> None:
    if args.seed is None or args.seed < 0:
        raise ValueError(f"--seed must be an integer >= 0 (it seeds the workload, so a bench "
                         f"run takes no None), got {args.seed}")


def build_workload(args: argparse.Namespace, vocab_size: int, num_prompts: int):
    """The seeded workload of the flags. Raises ValueError naming --seed when it is negative
    (numpy seeds the workload; the engine's --seed itself takes any integer)."""
    from pagedllm.benchmarks.workload import WorkloadSpec, make_workload, parse_len_range
    _check_workload_seed(args)

    spec = WorkloadSpec(num_prompts=num_prompts, vocab_size=vocab_size,
                        input_len=args.input_len, output_len=args.output_len,
                        random_input_len=parse_len_range(args.random_input_len),
                        random_output_len=parse_len_range(args.random_output_len),
                        seed=args.seed, token_low=args.token_low)
    return make_workload(spec)


def _vocab_size(model_path: str) -> int:
    from pagedllm.hf_config import hf_model_info
    from pagedllm.model_loader.gguf import is_gguf_path, prepare_gguf_view

    if is_gguf_path(model_path):
        model_path = prepare_gguf_view(model_path)
    return hf_model_info(model_path).vocab_size


def _run_dtype_name(requested: str) -> str:
    """The dtype the engine runs in ("auto" resolved by the platform)."""
    from pagedllm.platforms import current_platform

    return str(current_platform.resolve_dtype(requested)).removeprefix("torch.")


def _finish(args: argparse.Namespace, results: list[dict[str, Any]],
            peers_not_run: Sequence[str] = ()) -> int:
    """Print the machine line and save the results; the exit status: 0, or 1 when a peer that
    --compare asked for could not run (our own figures are printed and saved all the same)."""
    from pagedllm.benchmarks.report import machine_info, save_json

    info = machine_info()
    print(f"machine: {info['cpu']}, {info['num_cpus']} CPUs, torch threads "
          f"{info['torch_threads']}, load average {info['load_avg_1m']}")
    if args.output_json:
        save_json(args.output_json, results,
                  {k: v for k, v in vars(args).items() if k != "func"})
        print(f"results saved to {args.output_json}")
    for peer in peers_not_run:
        print(f"error: --compare {peer} did not run (see above)", file=sys.stderr)
    return 1 if peers_not_run else 0


# ------------------------------------------------------------------ runners
def check_throughput_flags(args: argparse.Namespace) -> None:
    """Refuse `bench throughput` flags that could not all take effect, before anything runs.

    Raises:
        ValueError: naming the flags: a negative --seed, --lora-rounds other than 1 without
            --num-loras, or a --lora-rank above --max-lora-rank (the engine would refuse
            every adapter).
    """
    _check_workload_seed(args)
    if args.lora_rounds != 1 and not args.num_loras:
        raise ValueError(f"--lora-rounds {args.lora_rounds} needs --num-loras (the rounds "
                         "alternate the base model and the adapters)")
    if args.num_loras and args.lora_rank > args.max_lora_rank:
        raise ValueError(f"--lora-rank {args.lora_rank} exceeds --max-lora-rank "
                         f"{args.max_lora_rank}: raise --max-lora-rank to at least "
                         f"{args.lora_rank}")


def run_throughput_command(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.benchmarks.co_tenants import StartBarrier
    from pagedllm.benchmarks.report import print_result
    from pagedllm.benchmarks.throughput import compare, run_throughput
    from pagedllm.benchmarks.workload import workload_summary

    check_throughput_flags(args)
    kwargs = resolve_model(args)
    check_llamacpp_peer(args, kwargs)
    model_path = kwargs["model"]
    if (args.co_tenants > 1 or args.busy_co_tenants) and args.co_tenant_barrier is None:
        return _run_co_tenants_command(args, kwargs)
    barrier = StartBarrier.from_arg(args.co_tenant_barrier) if args.co_tenant_barrier else None
    requests = build_workload(args, _vocab_size(model_path), args.num_prompts)
    print_result(workload_summary(requests), "workload")
    if args.num_loras:
        return _run_lora_throughput(args, kwargs, requests)
    llm = LLM(**kwargs)
    ours, ours_tokens = run_throughput(
        llm, requests, before_timing=barrier and (lambda: barrier.wait("pagedllm")))
    ours.update(model=model_path, dtype=_run_dtype_name(kwargs["dtype"]))
    print_result(ours, "pagedllm throughput")
    results, not_run = [ours], []
    del llm
    gc.collect()
    for baseline in dict.fromkeys(args.compare):
        figures, tokens = _run_baseline(baseline, args, kwargs, requests,
                                        barrier and (lambda b=baseline: barrier.wait(b)))
        if figures is None:
            not_run.append(baseline)
            continue
        print_result(figures, f"{baseline} throughput")
        ratios = compare(ours, figures, ours_tokens, tokens)
        print_result(ratios, f"pagedllm / {baseline}")
        figures["comparison"] = ratios
        results.append(figures)
    return _finish(args, results, not_run)


def _run_lora_throughput(args: argparse.Namespace, kwargs: dict[str, Any], requests) -> int:
    """`--num-loras N`: the workload on the base model, then under N adapters, in one engine;
    with `--compare hf`, HF + peft one adapter at a time."""
    import tempfile

    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.lora import (request_loras, run_hf_peft_throughput,
                                          write_random_adapters)
    from pagedllm.benchmarks.report import print_result
    from pagedllm.benchmarks.throughput import compare, run_throughput, warmup_prompt
    from pagedllm.platforms import current_platform

    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-loras-") as folder:
        loras = write_random_adapters(kwargs["model"], folder, args.num_loras, args.lora_rank)
        kwargs = dict(kwargs, enable_lora=True, max_loras=max(kwargs["max_loras"], len(loras)),
                      max_lora_rank=kwargs["max_lora_rank"])
        llm = LLM(**kwargs)
        rounds = []
        for k in range(args.lora_rounds):
            base, _ = run_throughput(llm, requests, warmup=k == 0)
            base.update(model=kwargs["model"], dtype=_run_dtype_name(kwargs["dtype"]))
            print_result(base, f"pagedllm throughput, base model (round {k + 1})")
            if k == 0:
                # Warm-up: every adapter loaded once, so the timed runs measure serving, not
                # disk reads.
                llm.generate([{"prompt_token_ids": warmup_prompt(requests)}] * len(loras),
                             SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False,
                             lora_request=loras)
            ours, tokens = run_throughput(llm, requests, warmup=False,
                                          lora_requests=request_loras(len(requests), loras))
            ours.update(backend="pagedllm+lora", num_loras=len(loras),
                        lora_rank=args.lora_rank)
            ratios = compare(ours, base)
            print_result(ours, f"pagedllm throughput, {len(loras)} adapters (round {k + 1})")
            print_result(ratios, f"pagedllm with adapters / base model (round {k + 1})")
            rounds.append(ratios["output_tokens_per_s_ratio"])
        ours["comparison"] = ratios
        if len(rounds) > 1:
            ratios["rounds_output_tokens_per_s_ratio"] = rounds
            ratios["median_output_tokens_per_s_ratio"] = statistics.median(rounds)
            print_result({"per_round": [round(r, 3) for r in rounds],
                          "median": round(statistics.median(rounds), 3)},
                         "adapters / base model, output tokens/s over the rounds")
        results, not_run = [base, ours], []
        del llm
        gc.collect()
        if "hf" in args.compare:
            try:
                figures, hf_tokens = run_hf_peft_throughput(
                    kwargs["model"], requests, loras,
                    current_platform.resolve_dtype(kwargs["dtype"]),
                    args.hf_batch_size or min(len(requests), 32))
            except ImportError as e:
                print(f"HF + peft baseline: {e}")
                figures = None
            if figures is None:
                not_run.append("hf")
            else:
                figures["comparison"] = compare(ours, figures, tokens, hf_tokens)
                print_result(figures, "hf+peft throughput")
                print_result(figures["comparison"], "pagedllm with adapters / hf+peft")
                results.append(figures)
        not_run += [p for p in dict.fromkeys(args.compare) if p != "hf"]
    return _finish(args, results, not_run)


def _run_co_tenants_command(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    """`--co-tenants` / `--busy-co-tenants`: the copies run this command in child processes
    (the preset and any GGUF conversion made once here, before they start)."""
    from pagedllm.benchmarks.co_tenants import run_co_tenants

    if "llamacpp" in args.compare:   # (llama.cpp checked by run_throughput_command)
        from pagedllm.benchmarks.llamacpp_baseline import gguf_for

        gguf_for(kwargs["model"], _run_dtype_name(kwargs["dtype"]), args.llamacpp_converter)
    bench_argv = args.argv[args.argv.index("throughput") + 1:]
    try:
        run_co_tenants(bench_argv, args.co_tenants, args.busy_co_tenants, args.output_json)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the copies and busy loops were stopped", file=sys.stderr)
        return 130
    return 0


def _run_baseline(name: str, args: argparse.Namespace, kwargs: dict[str, Any], requests,
                  before_timing=None):
    from pagedllm.platforms import current_platform

    dtype = current_platform.resolve_dtype(kwargs["dtype"])
    if name == "hf":
        from pagedllm.benchmarks.hf_baseline import run_hf_throughput

        batch_size = args.hf_batch_size or min(len(requests), 32)
        figures, tokens = run_hf_throughput(kwargs["model"], requests, dtype, batch_size,
                                            before_timing=before_timing)
        figures["dtype"] = str(dtype).removeprefix("torch.")
        return figures, tokens
    from pagedllm.benchmarks.llamacpp_baseline import run_llamacpp_throughput

    try:
        return run_llamacpp_throughput(
            kwargs["model"], requests, str(dtype).removeprefix("torch."),
            args.llamacpp_converter,
            num_threads=args.llamacpp_threads,
            batch_size=args.llamacpp_batch_size or min(len(requests), 64),
            before_timing=before_timing)
    except RuntimeError as e:
        print(str(e))
        return None, None


def run_latency_command(args: argparse.Namespace) -> int:
    """`pagedllm bench latency` (benchmarks/latency_cli.py)."""
    from pagedllm.benchmarks.latency_cli import run_latency_command as run

    return run(args)


def run_gemm_command(args: argparse.Namespace) -> int:
    """The GEMM probe (`latency.measure_linear_gemm`): one line per (shape, rows).

    Raises:
        ValueError: a malformed --rows or --shapes.
    """
    import os

    import torch

    from pagedllm.benchmarks.latency import measure_fma_peak, measure_linear_gemm

    def parse(text: str, split) -> list:
        try:
            return [split(part) for part in text.split(",")]
        except ValueError:
            return []

    rows = parse(args.rows, int)
    shapes = parse(args.shapes, lambda s: tuple(int(v) for v in s.lower().split("x")))
    if not rows or min(rows) < 1:
        raise ValueError(f"--rows must be comma-separated positive integers, got {args.rows!r}")
    if not shapes or any(len(s) != 2 or min(s) < 1 or s[1] % 8 for s in shapes):
        raise ValueError(f"--shapes must be comma-separated NxK pairs of positive integers with "
                         f"K a multiple of 8, got {args.shapes!r}")
    peak = measure_fma_peak()
    table = measure_linear_gemm(shapes, rows, getattr(torch, args.dtype))
    if not table:
        print("the native CPU kernels are unavailable: nothing to measure")
        return 1
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, FMA peak "
          + ", ".join(f"{k} {v:.1f}" for k, v in peak.items() if v is not None))
    print(f"{'N':>6} {'K':>5} {'M':>4} {'dot kernel':>11} {'packed':>8} {'torch':>8} "
          f"{'packed/peak':>11}  (GFLOP/s, {args.dtype})")
    for r in table:
        print(f"{r['n']:>6} {r['k']:>5} {r['m']:>4} {r['dot_kernel_gflops']:>11.1f} "
              f"{r['packed_gflops']:>8.1f} {r['torch_gflops']:>8.1f} "
              f"{r['packed_fraction_of_peak']:>11.2f}")
    return _finish(args, [{"fma_peak": peak, "dtype": args.dtype, "gemm": table}])


def run_perplexity_command(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.perplexity import run_perplexity
    from pagedllm.benchmarks.report import print_result

    if args.max_windows is not None and args.max_windows < 1:
        raise ValueError("--max-windows must be >= 1")
    kwargs = resolve_model(args)
    check_llamacpp_peer(args, kwargs)
    result, windows = run_perplexity(kwargs, args.input_file, args.window, args.max_windows)
    result["dtype"] = _run_dtype_name(kwargs["dtype"])
    print_result(result, "pagedllm perplexity")
    results, not_run = [result], []
    if "llamacpp" in args.compare:
        from pagedllm.benchmarks.llamacpp_baseline import run_llamacpp_perplexity

        try:
            theirs = run_llamacpp_perplexity(kwargs["model"], windows, result["dtype"],
                                             args.llamacpp_converter)
        except RuntimeError as e:
            print(str(e))
            not_run.append("llamacpp")
        else:
            theirs["perplexity_ratio"] = result["perplexity"] / theirs["perplexity"]
            print_result(theirs, "llama.cpp perplexity (same windows)")
            results.append(theirs)
    return _finish(args, results, not_run)


def _request_rate(text: str) -> float:
    """argparse type of `bench serve --request-rate`: a number > 0 or inf (all at once)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:       # also nan
        raise argparse.ArgumentTypeError(f"expected a number > 0 (requests/s) or inf, "
                                         f"got {text!r}")
    return value


def _http_url(text: str) -> str:
    """argparse type of `bench serve --base-url`: an http:// or https:// URL."""
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text


def run_serve_command(args: argparse.Namespace) -> int:
    """`pagedllm bench serve`: 0, or 1 when the server cannot be reached or every request
    failed (the figures would all be nan; the first errors are printed)."""
    import httpx

    from pagedllm.benchmarks.report import print_result
    from pagedllm.benchmarks.serve import run_serve_benchmark

    try:
        vocab_size = args.vocab_size or _serve_vocab_size(args)
        requests = build_workload(args, vocab_size, args.num_prompts)
        result = asyncio.run(run_serve_benchmark(args.base_url, requests, args.request_rate,
                                                 args.max_concurrency, args.model, args.seed,
                                                 args.api_key))
    except httpx.HTTPError as e:    # the model lookup (GET /v1/models) failed
        raise ValueError(f"cannot reach the server at {args.base_url} "
                         f"({type(e).__name__}: {e})") from None
    print_result(result, "server benchmark")
    status = _finish(args, [result])
    if result["num_successful"] == 0:
        print(f"error: all {result['num_requests']} requests failed (first: "
              f"{'; '.join(result['first_errors'])})", file=sys.stderr)
        return 1
    return status


def run_soak_command(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.soak import run_soak_command as run

    return run(args)


def _serve_vocab_size(args: argparse.Namespace) -> int:
    if args.preset:
        from pagedllm.benchmarks.presets import PRESETS

        if args.preset not in PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}; known: {sorted(PRESETS)}")
        return PRESETS[args.preset]["vocab_size"]
    import httpx

    from pagedllm.benchmarks.serve import fetch_served_model

    async def root() -> str | None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(headers=headers, timeout=30) as client:
            return (await fetch_served_model(client, args.base_url.rstrip("/")))[1]

    path = asyncio.run(root())
    try:
        return _vocab_size(path) if path else _missing_vocab()
    except (FileNotFoundError, OSError, KeyError):
        return _missing_vocab()


def _missing_vocab() -> int:
    raise ValueError("cannot tell the server model's vocabulary size; pass --vocab-size or "
                     "--preset")
