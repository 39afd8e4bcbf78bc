"""`pagedllm` command line: generate (offline), chat (interactive, in the terminal), serve (OpenAI
server), bench, verify (against transformers)."""

from __future__ import annotations

import argparse
import sys

from pagedllm.benchmarks.cli import add_bench_parser
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from pagedllm.entrypoints.chat_cli import add_chat_parser
from pagedllm.entrypoints.cli_parser import CLIArgumentParser
from pagedllm.entrypoints.cli_sampling import add_sampling_args
from pagedllm.entrypoints.openai.cli_args import add_serve_parser
from pagedllm.entrypoints.openai.pd_proxy import add_proxy_parser
from pagedllm.entrypoints.verify import add_verify_parser

# Tokens `pagedllm generate` makes when neither --max-tokens nor the model's max_new_tokens says.
DEFAULT_MAX_TOKENS = 64


def _add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat the flag for a batch)")
    add_sampling_args(p, str(DEFAULT_MAX_TOKENS))
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the chat template")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print tokens as they are generated (default: on when the output is a "
                        "terminal); with several prompts, streaming runs them one after "
                        "another, --no-stream runs them as one batch and prints whole texts")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.cli_sampling import given_sampling_kwargs

    try:
        given = given_sampling_kwargs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kwargs = engine_kwargs_from_args(args)
    if args.chat:
        from pagedllm.entrypoints.chat_template_check import require_chat_template
        require_chat_template(kwargs["model"], args.tokenizer, args.chat_template)
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.cli_stream import add_cli_request, run_streams
    from pagedllm.entrypoints.llm import chat_prompt_token_ids

    llm = LLM(**kwargs)
    engine = llm.llm_engine
    params = SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS,
                               **engine.config.default_sampling_params, **given})
    prompts = [{"prompt_token_ids": chat_prompt_token_ids(
        engine.tokenizer, [{"role": "user", "content": p}])} if args.chat else p
        for p in args.prompt]
    # The prompt's text starts its output (a chat prompt's template markup does not).
    shown = [""] * len(prompts) if args.chat else list(args.prompt)
    stream = sys.stdout.isatty() if args.stream is None else args.stream
    batches = [[i] for i in range(len(prompts))] if stream else [list(range(len(prompts)))]
    results, elapsed = [], 0.0
    for batch in batches:
        ids = [add_cli_request(engine, prompts[i], params, "max_tokens" in given) for i in batch]
        if stream:
            print(shown[batch[0]], end="", flush=True)
        done = run_streams(engine, ids, (lambda _, text: print(text, end="", flush=True))
                           if stream else None)
        for i, request_id in zip(batch, ids):
            results.append(done[request_id])
            print("" if stream else shown[i] + done[request_id].text)
            print("-" * 40)
        elapsed += max(done[r].elapsed for r in ids)
        if any(done[r].interrupted for r in ids):
            raise KeyboardInterrupt
    n_gen = sum(r.num_output_tokens for r in results)
    print(f"prompt tokens: {sum(r.num_prompt_tokens for r in results)}, generated tokens: "
          f"{n_gen}, time: {elapsed:.2f} s, {n_gen / max(elapsed, 1e-9):.1f} tokens/s (model "
          f"loading and kernel compilation excluded), finish: "
          f"{','.join(str(r.finish_reason) for r in results)}")
    errors = [r.error for r in results if r.error]
    if errors:
        print(f"error: {'; '.join(errors)}", file=sys.stderr)
        return 1
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
    parser = CLIArgumentParser(prog="pagedllm", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    add_chat_parser(subparsers)
    _add_worker_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_verify_parser(subparsers)
    add_proxy_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # as given (bench --co-tenants)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C anywhere (loading, generating, bench, verify): what was printed stays, one
        # line says why it ended, and the status is the shell's for SIGINT (128 + 2).
        print("\n^C interrupted", file=sys.stderr)
        return 130
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
    except Exception as e:
        if not _is_config_validation_error(e):
            raise
        print(f"error: invalid model config (config.json): {e}", file=sys.stderr)
        return 1


def _is_config_validation_error(e: BaseException) -> bool:
    """Whether `e` is transformers 5's check of a config.json (huggingface_hub's
    `StrictDataclassError`: a field of the wrong type, or a failed validator such as an unknown
    `layer_types` entry). Its message names the field; it is no ValueError, so without this it
    reached the user as a traceback."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:   # older huggingface_hub: transformers raised ValueErrors then
        return False
    return isinstance(e, StrictDataclassError)


if __name__ == "__main__":
    sys.exit(main())
