"""`pagedllm` command line: generate (offline), serve (OpenAI server), bench, verify (against
transformers)."""

from __future__ import annotations

import argparse
import sys
import time

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from pagedllm.entrypoints.openai.cli_args import add_serve_parser
from pagedllm.entrypoints.verify import add_verify_parser

# Tokens `pagedllm generate` makes when neither --max-tokens nor the model's max_new_tokens says.
DEFAULT_MAX_TOKENS = 64


def _add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat the flag for a batch)")
    # Sampling flags left out take the model's default (--generation-config), else the built-in
    # one (SamplingParams'; max tokens DEFAULT_MAX_TOKENS).
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"default: the model's max_new_tokens, else {DEFAULT_MAX_TOKENS}")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's, else 1.0")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    p.add_argument("--top-k", type=int, default=None,
                   help="default: the model's, else 0 (off)")
    p.add_argument("--min-p", type=float, default=None, help="default: the model's, else 0.0")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: the model's, else 1.0")
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the chat template")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty}
    given = {name: value for name, value in given.items() if value is not None}
    given.update(stop=args.stop, seed=args.request_seed, ignore_eos=args.ignore_eos)
    try:
        SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS, **given})  # before the model loads
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM(**engine_kwargs_from_args(args))
    params = SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS,
                               **llm.llm_engine.config.default_sampling_params, **given})
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    n_gen = sum(len(o.outputs[0].token_ids) for o in outputs)
    for o in outputs:
        print(((o.prompt or "") if not args.chat else "") + o.outputs[0].text)
        print("-" * 40)
    print(f"prompt tokens: {n_prompt}, generated tokens: {n_gen}, time: {elapsed:.2f} s, "
          f"{n_gen / elapsed:.1f} tokens/s, finish: "
          f"{','.join(str(o.outputs[0].finish_reason) for o in outputs)}")
    return 0


def _add_worker_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "worker", help="run the ranks of node --node-rank >= 1 of a multi-node layout (give "
                       "the same engine arguments as on node 0)")
    add_engine_args(p)
    p.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from pagedllm.config import create_engine_config
    from pagedllm.logger import init_logger
    from pagedllm.executor.multiproc import run_headless

    init_logger()
    kwargs = engine_kwargs_from_args(args)
    return run_headless(create_engine_config(kwargs.pop("model"), **kwargs))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    _add_worker_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_verify_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # as given (bench --co-tenants)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        # A worker process that died (e.g. killed for memory) is reported by its message; other
        # runtime errors keep their traceback. Imported here: the executor loads torch.
        from pagedllm.executor.abstract import WorkerDiedError
        if not isinstance(e, WorkerDiedError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
