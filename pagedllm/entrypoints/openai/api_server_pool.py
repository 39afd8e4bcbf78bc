"""`pagedllm serve --api-server-count N` (vLLM's name): N API-server processes on one port, all
talking to the same engine-core process(es).

    launcher (this process)
      checks host:port is free            each API server listens on host:port with
      spawns D engine-core processes      SO_REUSEPORT: the kernel spreads new connections over
      spawns N API-server processes       them by a hash of the client's address and port; each:
      waits                               HTTP, JSON, tokenization, detokenization, routing over
                                          the D cores (core_client.AttachLauncher)

      API server a ──PUSH ipc in_{d,a}──► engine core d (one PULL per API server; a request's
                   ◄─PULL ipc out_{d,a}──  outputs go back to the API server it came from)

Why: one front-end process is one GIL for HTTP, JSON, tokenization and detokenization of every
stream; with the engine core in its own process that GIL bounds the server once the core is
fast, and N front ends lift the bound (as vLLM's API-server scale-out does). Everything stays on
this machine: the sockets are IPC in a private (0700) folder, and the cores listen on nothing.

Life cycle: SIGTERM or SIGINT to the launcher -> SIGTERM to every API server (each shuts down
gracefully, as a single server does), then the cores are stopped through their stop pipe (the
launcher closes its end); exit 0. A core that dies makes every API server fail its requests and
exit 1; any API server that exits on its own stops the pool, and the launcher exits 1. The cores
ignore SIGTERM and SIGINT (engine/core_proc.py): a Ctrl-C, systemd's stop or `kill -TERM
-<pgid>` reaches the whole process group, and only the launcher and the API servers react to
it, so the API servers end gracefully over live cores and the whole pool exits 0. A core that
must go at once is killed (SIGKILL): that is an engine death (exit 1).

Metrics: /metrics of any API server shows the whole server (prometheus_client's multiprocess
mode over a private folder made here and removed at exit; metrics.py). Limits
(docs/distributed.md): sleep mode and runtime LoRA changes made through one API server are not
known to the others, so they are refused with more than one API server.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.config import create_engine_config
from pagedllm.engine.core_client import AttachLauncher
from pagedllm.engine.core_proc import CoreEndpoints, run_engine_core
from pagedllm.entrypoints.openai.metrics import setup_multiprocess_metrics
from pagedllm.executor.multiproc import check_main_reimportable
from pagedllm.logger import init_logger

logger = logging.getLogger(__name__)

# Seconds the API servers get to end gracefully after SIGTERM, and the cores after them.
_STOP_GRACE_S = 40.0


def run_api_server_pool(model: str, engine_kwargs: dict[str, Any], api_server_count: int,
                        host: str, port: int, data_parallel_size: int = 1,
                        server_kwargs: dict[str, Any] | None = None) -> int:
    """Start `data_parallel_size` engine cores and `api_server_count` API servers sharing
    host:port, and wait (see the module docstring).

    Args:
        engine_kwargs: as for `run_server` (`multiprocess_mode` is implied).
        server_kwargs: `run_server`'s other keyword arguments, for every API server.

    Returns:
        0 after SIGTERM/SIGINT, 1 if an engine core or an API server failed.

    Raises:
        ValueError: invalid engine arguments (before anything starts).
    """
    init_logger()
    check_main_reimportable("spawn")
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "multiprocess_mode"}
    if engine_kwargs.get("num_scheduler_steps") is None:
        engine_kwargs["num_scheduler_steps"] = 1    # as AsyncLLM.from_engine_args
    config = create_engine_config(model, data_parallel_size_local=data_parallel_size,
                                  **engine_kwargs)
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="pagedllm-api-pool-")   # mode 0700: this user only
    endpoints = [[CoreEndpoints(f"ipc://{folder}/in-{d}-{a}", f"ipc://{folder}/out-{d}-{a}")
                  for a in range(api_server_count)] for d in range(data_parallel_size)]
    # Held (bound, not listening) until the API servers listen: nobody else takes the port.
    # (Only processes of this user may join a SO_REUSEPORT group on Linux.)
    placeholder = reuse_port_socket(host, port)
    cores: list[mp.process.BaseProcess] = []
    servers: list[mp.process.BaseProcess] = []
    wake_r, wake_w = os.pipe()
    # The cores' stop pipe: they stop when this end is closed (or the launcher dies).
    stop_r, stop_w = ctx.Pipe(duplex=False)
    stopping: list[int] = []
    clean_up_metrics: Callable[[], None] = lambda: None

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)
        os.write(wake_w, b"\0")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # The cores start with SIGINT and SIGTERM ignored (Python keeps an inherited SIG_IGN;
        # run_engine_core ignores them too once it runs): a signal to the process group is the
        # API servers' to handle.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        for d in range(data_parallel_size):
            # Each core's workers take their share of this machine's cores.
            local = dataclasses.replace(config, parallel_config=dataclasses.replace(
                config.parallel_config, data_parallel_rank_local=d))
            core = ctx.Process(target=run_engine_core, name=f"pagedllm-engine-core-{d}",
                               args=(local, endpoints[d], os.getpid(), stop_r))
            core.start()
            cores.append(core)
        for sig in previous:
            signal.signal(sig, on_signal)
        # One /metrics for all API servers (prometheus_client's multiprocess mode, metrics.py).
        clean_up_metrics = setup_multiprocess_metrics()
        for a in range(api_server_count):
            launchers = [AttachLauncher(endpoints[d][a], cores[d].pid)
                         for d in range(data_parallel_size)]
            server = ctx.Process(target=_api_server_main, name=f"pagedllm-api-server-{a}",
                                 args=(a, host, port, model, engine_kwargs, launchers,
                                       server_kwargs or {}))
            server.start()
            servers.append(server)
        logger.info("%d API servers (pids %s) on http://%s:%d, %d engine cores (pids %s)",
                    api_server_count, [s.pid for s in servers], host, port,
                    data_parallel_size, [c.pid for c in cores])
        return _wait(cores, servers, wake_r, stopping)
    finally:
        placeholder.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(servers, cores, stop_w)
        stop_r.close()
        clean_up_metrics()
        os.close(wake_r)
        os.close(wake_w)
        shutil.rmtree(folder, ignore_errors=True)


def _wait(cores: Sequence[mp.process.BaseProcess], servers: Sequence[mp.process.BaseProcess],
          wake_r: int, stopping: list[int]) -> int:
    """Until a signal (0 if every API server then ends with 0) or a child's exit (1)."""
    sentinels = {p.sentinel: p for p in (*cores, *servers)}
    while not stopping:
        ready = multiprocessing.connection.wait([*sentinels, wake_r])
        ended = [sentinels[s] for s in ready if s in sentinels]
        if ended and not stopping:
            for proc in ended:
                proc.join()
                logger.error("%s (pid %d) exited with status %s: stopping the API servers "
                             "and engine cores", proc.name, proc.pid, proc.exitcode)
            return 1
    for server in servers:
        if server.is_alive():
            server.terminate()     # SIGTERM: a graceful shutdown
    for server in servers:
        server.join(_STOP_GRACE_S)
    return 0 if all(s.exitcode == 0 for s in servers) else 1


def _stop(servers: Sequence[mp.process.BaseProcess], cores: Sequence[mp.process.BaseProcess],
          stop_cores: multiprocessing.connection.Connection) -> None:
    """Stop every process still alive, API servers first (SIGTERM), then the cores (EOF on
    their stop pipe, whose write end `stop_cores` is: they ignore SIGTERM); wait for each up
    to the grace period, then SIGKILL."""
    for proc in servers:
        if proc.is_alive():
            proc.terminate()
    _join_or_kill(servers)
    stop_cores.close()
    _join_or_kill(cores)


def _join_or_kill(procs: Sequence[mp.process.BaseProcess]) -> None:
    for proc in procs:
        proc.join(_STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEADDR and SO_REUSEPORT (not listening yet).

    Raises:
        ValueError: host:port cannot be bound (in use without SO_REUSEPORT, not local).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _api_server_main(index: int, host: str, port: int, model: str,
                     engine_kwargs: dict[str, Any], launchers: list[AttachLauncher],
                     server_kwargs: dict[str, Any]) -> None:
    """One API server of the pool: `run_server` on its own SO_REUSEPORT socket of host:port,
    over the pool's cores."""
    from pagedllm.entrypoints.openai.api_server import run_server

    sys.exit(run_server(model, engine_kwargs, core_launchers=launchers,
                        sockets=[reuse_port_socket(host, port)], **server_kwargs))
