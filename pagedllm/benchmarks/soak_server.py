"""The server side of `pagedllm bench soak`: the `pagedllm serve` process it starts, the loopback
check of a `--url`, and readings of a server (/metrics gauges, RSS).

`ManagedServer` owns one subprocess in its own session, logging to a file; `stop()` always ends it
(SIGTERM, then SIGKILL of its whole process group after a grace period), so the soak never
leaves a server behind.

RSS is the server's whole process tree (`process_tree_rss`): the launcher and every descendant,
such as the engine-core process (`--multiprocess-mode`), the API-server processes
(`--api-server-count`), data-parallel replicas and tensor-parallel workers; the launcher alone
can be a small fraction of the server. It is read from /proc (Linux, as the rest of the soak's
readings): psutil would do the same, but the package does not depend on it. The sum counts a
page shared by several processes (the Python and torch libraries' code) once per process; the
drift check compares sums of the same tree, so that share cancels out.
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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ProcessRss:
    """One process of a tree: its pid, parent's pid, name (/proc's `comm`) and RSS in bytes."""

    pid: int
    ppid: int
    name: str
    rss_bytes: int


def _stat_fields(pid: int) -> tuple[str, int] | None:
    """(comm, ppid) of a live process from /proc/PID/stat; None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    name = text[text.find("(") + 1:text.rfind(")")]
    state, ppid = text[text.rfind(")") + 2:].split()[:2]
    return None if state in ("Z", "X") else (name, int(ppid))


def process_tree_rss(root_pid: int) -> list[ProcessRss]:
    """`root_pid` and each of its live descendants with its RSS, the root first, then by depth
    (parents are found from every process's /proc/PID/stat); [] if the root cannot be read. A
    process that ends while the tree is read is left out."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                names[int(entry)] = fields[0]
                children.setdefault(fields[1], []).append(int(entry))
    if root_pid not in names:
        return []
    tree, frontier, parent_of = [], [root_pid], {root_pid: 0}
    while frontier:
        pid = frontier.pop(0)
        rss = process_rss_bytes(pid)
        if rss is not None:
            tree.append(ProcessRss(pid, parent_of[pid], names[pid], rss))
        for child in sorted(children.get(pid, ())):
            parent_of[child] = pid
            frontier.append(child)
    return tree


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
        """The RSS summed over the server's process tree (None: not started, or gone)."""
        tree = self.rss_by_process()
        return sum(p.rss_bytes for p in tree) if tree else None

    def rss_by_process(self) -> list[ProcessRss]:
        """The server's processes with their RSS (`process_tree_rss`; [] when not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return process_tree_rss(self.proc.pid)

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
        """SIGKILL the server's whole process group (its session: every process it started
        that did not leave it), then reap the launcher."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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
