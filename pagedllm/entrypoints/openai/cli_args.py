"""`pagedllm serve` flags and runner (the server modules are imported only when serving)."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.cli_args import add_engine_args, engine_kwargs_from_args


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server flags plus the shared engine flags (--model, --dtype, ...)."""
    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (all routes but /health, /metrics)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: --model, or the shipped model's "
                        "name)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind this server, balanced by queue length")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: serve /v1/embeddings (docs/embeddings.md); auto: pooling for "
                        "models without an LM head (e.g. BertModel)")
    g.add_argument("--pooling-type", default=None, choices=["MEAN", "CLS", "LAST"],
                   help="with --runner pooling: override the model's pooling")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="with --runner pooling: override the model's L2 normalisation")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the `pagedllm` command's subparsers (runs `run_serve`)."""
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(parser)
    parser.set_defaults(func=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code (0).

    Raises:
        ValueError, FileNotFoundError: invalid engine arguments or a missing model.
    """
    from pagedllm.assets import DEFAULT_MODEL_NAME
    from pagedllm.entrypoints.openai.api_server import run_server

    kwargs = engine_kwargs_from_args(args)
    model = kwargs.pop("model")
    names = args.served_model_name or [args.model if args.model is not None
                                       else DEFAULT_MODEL_NAME]
    for key in ("pooling_type", "normalize"):
        if getattr(args, key) is not None:
            if args.runner != "pooling":
                raise ValueError(f"--{key.replace('_', '-')} needs --runner pooling")
            kwargs[key] = getattr(args, key)
    run_server(model, kwargs, host=args.host, port=args.port, api_key=args.api_key,
               served_model_names=names, log_level=args.uvicorn_log_level, runner=args.runner,
               data_parallel_size=args.data_parallel_size)
    return 0
