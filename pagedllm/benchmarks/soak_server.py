"""The server side of `pagedllm bench soak`: the `pagedllm serve` process it starts, the loopback
check of a `--url`, and readings of a server (/metrics gauges, RSS).

`ManagedServer` owns one subprocess in its own session, logging to a file; `stop()` always ends it
(SIGTERM, then SIGKILL after a grace period), so the soak never leaves a server behind.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

import httpx

# Gauges of pagedllm/entrypoints/openai/metrics.py that must be back to 0 once the server idles.
IDLE_GAUGES = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
               "pagedllm:kv_cache_usage_perc")
PREEMPTIONS = "pagedllm:num_preemptions_total"
_KV_LINE = re.compile(r"KV cache: (\d+) blocks x (\d+) tokens = (\d+) tokens")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def loopback_url(url: str) -> tuple[str, int]:
    """(host, port) of an http:// URL whose host is a loopback address.

    Raises:
        ValueError: for another scheme, or a host that is not (or does not resolve to) loopback.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--url must be http://HOST:PORT, got {url!r}")
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"--url host {parts.hostname!r} does not resolve: {e}") from e
    if not infos or not all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos):
        raise ValueError(f"the soak only targets loopback servers; {parts.hostname!r} is not "
                         "a loopback address")
    return parts.hostname, parts.port or 80


def parse_metrics(text: str) -> dict[str, float]:
    """{metric name: value summed over its label sets} of a Prometheus text exposition."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
    return values


def process_rss_bytes(pid: int) -> int | None:
    """VmRSS of a process from /proc, or None if it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """`pagedllm serve` on a free loopback port, started by the soak.

    Args:
        serve_args: flags after `serve` (the port is added here).
        api_key: the key the server requires (None: none).
    """

    def __init__(self, serve_args: list[str], api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *serve_args,
                    "--host", "127.0.0.1", "--port", str(self.port)]
        if api_key:
            self.cmd += ["--api-key", api_key]
        self.log_path = ""
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        """Spawn the server and wait until GET /health answers 200.

        Raises:
            RuntimeError: if it exits or is not healthy within `timeout_s` (with its log's tail).
        """
        fd, self.log_path = tempfile.mkstemp(prefix="pagedllm-soak-server-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            # NOTE(soak): a session of its own, so a Ctrl-C at the terminal reaches only the soak,
            # which then stops the server itself (and sees it stop).
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during "
                                   f"start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.25)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        """None while the process runs."""
        return self.proc.poll() if self.proc is not None else None

    def rss_bytes(self) -> int | None:
        return process_rss_bytes(self.proc.pid) if self.proc is not None else None

    def kv_capacity(self) -> dict[str, int] | None:
        """{"blocks", "block_size", "tokens"} from the server's start-up log, if it said."""
        match = _KV_LINE.search(self.log_text())
        if match is None:
            return None
        blocks, block_size, tokens = (int(g) for g in match.groups())
        return {"blocks": blocks, "block_size": block_size, "tokens": tokens}

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def remove_log(self) -> None:
        if self.log_path:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass
