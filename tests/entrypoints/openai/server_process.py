"""Start `pagedllm serve` as a subprocess on a free loopback port for a test module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = STARTUP_TIMEOUT_S,
                 poll_s: float = 0.25) -> None:
    """Wait until the server process `proc` answers `url`/health with 200, polling every
    `poll_s` seconds. Raises AssertionError when it exits first (naming its status) or is not
    healthy within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode} during start-up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy in time"
        time.sleep(poll_s)


@contextmanager
def running_server(serve_args: list[str], env: dict[str, str] | None = None, stderr=None,
                   startup_timeout_s: float = STARTUP_TIMEOUT_S
                   ) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run `pagedllm serve SERVE_ARGS --port P`, wait for /health, yield (process, base url);
    on exit SIGTERM it and require a graceful exit (status 0). `stderr`: where the server's
    log goes (a file object; default: this process's stderr)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *serve_args,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, startup_timeout_s)
        yield proc, url
        # Graceful shutdown: SIGTERM must stop uvicorn and the engine, exit code 0.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
