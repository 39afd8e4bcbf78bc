"""`pagedllm serve` flags and runner (the server modules are imported only when serving).

Every flag is checked before the model loads: the value of each by its argparse type (exit
status 2), then in `check_serve_args` what needs the others or the machine (exit status 1 via
`pagedllm.entrypoints.cli`): pooling-only flags, local model folders, and that the server can
listen on --host:--port. The engine validates its own flags when it builds its config, which
also precedes loading.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket

from pagedllm.config import ROUTING_POLICIES
from pagedllm.engine.arg_utils import (add_engine_args, bounded_int, engine_kwargs_from_args,
                                       non_empty)
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.lora.request import LoRAModulePath
from pagedllm.multimodal.fetch import MediaFetcher

_SERVE_USAGE = "%(prog)s [--model MODEL] [--host HOST] [--port PORT] [options] (see --help)"


def _api_key(text: str) -> str:
    """argparse type of --api-key: not empty (that would turn authentication off) and without
    surrounding whitespace (HTTP clients strip it, so no request could match)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (omit --api-key to serve without "
                                         "authentication)")
    if text != text.strip():
        raise argparse.ArgumentTypeError("must not start or end with whitespace")
    return text


def parse_lora_module(text: str) -> LoRAModulePath:
    """argparse type of `--lora-modules` values: `name=path` or a JSON object with "name",
    "path" and optionally "base_model_name" (vLLM's two forms)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
        if not isinstance(value, dict) or not {"name", "path"} <= set(value) \
                or not set(value) <= {"name", "path", "base_model_name"} \
                or not all(isinstance(v, str) and v.strip() for v in value.values()):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ..., '
                                             f'"base_model_name": ...}} strings, got {text!r}')
        return LoRAModulePath(**value)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return LoRAModulePath(name.strip(), path.strip())


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server flags plus the shared engine flags (--model, --dtype, ...)."""
    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", type=non_empty, default="127.0.0.1",
                   help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=bounded_int(0, 65535), default=8000,
                   help="TCP port, 0..65535 (0: any free port; default 8000)")
    g.add_argument("--api-key", type=_api_key, default=None,
                   help="require `Authorization: Bearer KEY` (all routes but /health, /metrics)")
    g.add_argument("--served-model-name", nargs="+", type=non_empty, default=None,
                   help="model name(s) clients use, all accepted in requests (default: "
                        "--model exactly as given, or shakespeare-10m for the shipped model)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default info: one line per request)")
    g.add_argument("--max-request-body-bytes", type=bounded_int(1), default=8 << 20,
                   help="larger request bodies get HTTP 413 (default 8 MiB)")
    g.add_argument("--data-parallel-size", "-dp", type=bounded_int(1), default=1,
                   help="engine replicas behind this server")
    g.add_argument("--data-parallel-routing-policy", default="prefix_aware",
                   choices=list(ROUTING_POLICIES),
                   help="how a request picks its replica: prefix_aware (the replica its prompt's "
                        "prefix went to, unless overloaded), least_loaded (fewest requests in "
                        "flight) or round_robin")
    g.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=["mp", "ray"],
                   help="where the replicas' engine cores run: mp (this machine) or ray (Ray "
                        "actors on a Ray cluster's nodes, joined through $RAY_ADDRESS; implies "
                        "--multiprocess-mode; docs/distributed.md)")
    g.add_argument("--data-parallel-address", "-dpa", type=non_empty, default=None,
                   help="with --data-parallel-backend ray: the address of this machine the "
                        "replicas connect to; the server's engine sockets bind there only "
                        "(default: the address Ray knows this node by)")
    g.add_argument("--api-server-count", "-asc", type=bounded_int(1), default=1,
                   help="API-server processes sharing --port, all talking to the engine "
                        "core process(es); > 1 implies --multiprocess-mode (docs/distributed.md)")
    g.add_argument("--multiprocess-mode", action=argparse.BooleanOptionalAction, default=False,
                   help="run each engine core (scheduler, executor, KV cache) in its own "
                        "process, talking to this server over ZeroMQ IPC sockets (default off: "
                        "one process; docs/distributed.md)")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: serve /v1/embeddings (docs/embeddings.md); auto: pooling for "
                        "models without an LM head (e.g. BertModel)")
    g.add_argument("--pooling-type", default=None, choices=["MEAN", "CLS", "LAST"],
                   help="with --runner pooling: override the model's pooling")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="with --runner pooling: override the model's L2 normalisation")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides whether to call tools, and '
                        "--tool-call-parser reads the calls from its text")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model family's tool-call format (hermes: Qwen2.5/3, Hermes; "
                        "llama3_json: Llama 3.1+; mistral: Mistral v0.3+)")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters to serve (needs --enable-lora): name=path or a JSON "
                        "object {\"name\", \"path\", \"base_model_name\"}; a request's "
                        "model field selects one by name")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
                        "--enable-lora)")
    g.add_argument("--allowed-media-domains", nargs="+", type=non_empty, default=None,
                   help="hosts (and their subdomains) whose http(s) image URLs the server "
                        "fetches; none by default (only data: URLs). A host resolving to a "
                        "private, loopback or link-local address must be listed itself")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="folder whose files file: image URLs may name (default: none)")
    g.add_argument("--max-media-bytes", type=bounded_int(1), default=20 << 20,
                   help="most bytes of one fetched image")
    g.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="most seconds to fetch one image URL, redirects included")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own `chat_template` (a Jinja template the server "
                        "renders; off by default, as in vLLM)")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the `pagedllm` command's subparsers (runs `run_serve`)."""
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                   usage=_SERVE_USAGE)
    add_serve_args(parser)
    parser.set_defaults(func=run_serve, cpu_reserved_cores=None)   # None: one core from 8
    return parser


def check_can_listen(host: str, port: int) -> None:
    """Check now that a server can listen on `host`:`port`, as uvicorn will after the model
    loads: asyncio binds every address `host` resolves to (skipping those of a disabled address
    family), so each is bound here with the same options, then closed.

    Raises:
        ValueError: "cannot listen on HOST:PORT: REASON": the host does not resolve, the port
            is in use or privileged, or no address is one of this machine's.
    """
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {where}: host {host!r} does not resolve "
                         f"({e.strerror})") from None
    not_local: OSError | None = None
    bound = 0
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # an address family this kernel lacks: asyncio skips it too
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise ValueError(f"cannot listen on {where}: {e.strerror or e}") from None
                not_local = e
                continue
            bound += 1
    if not bound:
        reason = not_local.strerror if not_local is not None else "no usable address"
        raise ValueError(f"cannot listen on {where}: {reason} (not an address of this "
                         f"machine)")


def _check_local_folder(flag: str, value: str | None) -> None:
    """FileNotFoundError for a --model/--tokenizer value that is a path (as the engine tells a
    path from a hub id: it starts with '.', '/' or '~', has more than one '/', or exists) but
    neither a folder nor a .gguf file; hub ids are left to the engine."""
    if value is None or os.path.isdir(value):
        return
    if value.lower().endswith(".gguf"):
        if not os.path.isfile(value):
            raise FileNotFoundError(f"{flag} {value}: no such GGUF file")
        return
    if value.startswith((".", "/", "~")) or value.count("/") > 1 or os.path.exists(value):
        what = ("is a file, not a checkpoint folder or .gguf file" if os.path.exists(value)
                else "no such folder")
        hint = " (a '~' after '=' is not expanded by the shell)" if value.startswith("~") else ""
        raise FileNotFoundError(f"{flag} {value}: {what}{hint}")


def check_serve_args(args: argparse.Namespace) -> None:
    """The checks of `pagedllm serve`'s flags that argparse cannot make alone, all cheap: run
    before anything loads.

    Raises:
        ValueError: a pooling-only flag without --runner pooling, --data-parallel-size > 1
            or --multiprocess-mode with --runner pooling, --data-parallel-size > 1 with the
            P2pShmConnector, or a --host/--port the server cannot listen on.
        FileNotFoundError: --model or --tokenizer is a path but not a folder, or
            --allowed-local-media-path is not a folder.
    """
    for key in ("pooling_type", "normalize"):
        if getattr(args, key) is not None and args.runner != "pooling":
            raise ValueError(f"--{key.replace('_', '-')} needs --runner pooling")
    if args.runner == "pooling" and args.data_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 is not supported with --runner pooling")
    if (args.data_parallel_size > 1 and (getattr(args, "kv_transfer_config", None) or {})
            .get("kv_connector") == "P2pShmConnector"):
        raise ValueError("--data-parallel-size > 1 is not supported with P2pShmConnector "
                         "(each replica would bind the same kv_port): run one prefill/decode "
                         "pair per port")
    if args.runner == "pooling" and args.multiprocess_mode:
        raise ValueError("--multiprocess-mode is not supported with --runner pooling")
    if args.data_parallel_backend == "ray" and args.runner == "pooling":
        raise ValueError("--data-parallel-backend ray is not supported with --runner pooling")
    if args.api_server_count > 1:
        if args.runner == "pooling":
            raise ValueError("--api-server-count > 1 is not supported with --runner pooling")
        if args.data_parallel_backend == "ray":
            raise ValueError("--api-server-count > 1 is not supported with "
                             "--data-parallel-backend ray (the engine cores' sockets are IPC)")
        if args.enable_sleep_mode or args.allow_runtime_lora_updating:
            raise ValueError("--api-server-count > 1 cannot be combined with "
                             "--enable-sleep-mode or --allow-runtime-lora-updating (a change "
                             "made through one API server would not be known to the others)")
    if args.data_parallel_backend != "ray" and args.data_parallel_address is not None:
        raise ValueError("--data-parallel-address needs --data-parallel-backend ray")
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    _check_local_folder("--model", args.model)
    _check_local_folder("--tokenizer", args.tokenizer)
    media_root = args.allowed_local_media_path
    if media_root is not None and not os.path.isdir(os.path.expanduser(media_root)):
        what = "is a file, not a folder" if os.path.exists(media_root) else "no such folder"
        raise FileNotFoundError(f"--allowed-local-media-path {media_root}: {what}")
    check_can_listen(args.host, args.port)


def run_serve(args: argparse.Namespace) -> int:
    """Check every flag (`check_serve_args`), then serve until SIGINT/SIGTERM (exit code 0) or
    until the engine dies (exit code 1).

    Raises:
        ValueError, FileNotFoundError: invalid flags or engine arguments, a missing model, or a
            --host:--port the server cannot listen on; all before the model loads.
    """
    check_serve_args(args)
    from pagedllm.entrypoints.openai.api_server import run_server
    from pagedllm.entrypoints.openai.serving_models import resolve_served_model_names

    kwargs = engine_kwargs_from_args(args)
    model = kwargs.pop("model")
    names = resolve_served_model_names(args.model, args.served_model_name)
    for key in ("pooling_type", "normalize"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    server_kwargs = dict(
        api_key=args.api_key, served_model_names=names, log_level=args.uvicorn_log_level,
        runner=args.runner, data_parallel_routing_policy=args.data_parallel_routing_policy,
        max_request_body_bytes=args.max_request_body_bytes,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        trust_request_chat_template=args.trust_request_chat_template,
        lora_modules=args.lora_modules or (),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        media_fetcher=MediaFetcher(
            tuple(args.allowed_media_domains or ()),
            args.allowed_local_media_path, args.max_media_bytes,
            args.media_fetch_timeout))
    if args.api_server_count > 1:
        from pagedllm.entrypoints.openai.api_server_pool import run_api_server_pool

        return run_api_server_pool(model, kwargs, args.api_server_count, args.host, args.port,
                                   args.data_parallel_size,
                                   {**server_kwargs, "host": args.host, "port": args.port})
    return run_server(model, kwargs, host=args.host, port=args.port,
                      data_parallel_size=args.data_parallel_size,
                      multiprocess_mode=args.multiprocess_mode,
                      data_parallel_backend=args.data_parallel_backend,
                      data_parallel_address=args.data_parallel_address, **server_kwargs)