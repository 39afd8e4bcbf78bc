"""`pagedllm bench throughput --co-tenants N [--busy-co-tenants K]`: the same benchmark, alone
and then as N copies at once beside K busy single-threaded processes, on one machine.

What it measures is how the engine holds its speed on a shared machine: the copies' threads
compete for the same cores (as a second engine, a data-parallel replica or a co-tenant's job
would), and every barrier of a kernel waits for its slowest thread. The copies load their
models first, then meet at a `StartBarrier` before each timed run (pagedllm's, then the
peers' of `--compare`), so their timed runs overlap. The report gives each copy's figures,
their sum, and the sum against the figure of one copy alone, measured first in the same run
(docs/benchmarks.md, "Shared machines").
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Seconds a copy waits at the barrier for the others (model loads included) before giving up.
BARRIER_TIMEOUT_S = 900.0
# Timed runs shorter than this do not overlap reliably (the barrier polls every 10 ms, the
# thread governor decides every 0.25 s): the report warns that such figures are noise.
MIN_TIMED_RUN_S = 2.0
_BUSY_LOOP = "while True: pass"


class StartBarrier:
    """`parties` processes meet before each timed phase: each writes `PHASE.INDEX` in a shared
    directory and waits until all have. A process that fails writes `abort` there (the parent
    does it for a copy that exits early), which ends every wait.

    Raises (from `wait`):
        RuntimeError: another party aborted, or the wait ran past `timeout_s` seconds.
    """

    def __init__(self, directory: str | Path, index: int, parties: int,
                 timeout_s: float = BARRIER_TIMEOUT_S) -> None:
        self.directory, self.index, self.parties = Path(directory), index, parties
        self.timeout_s = timeout_s

    @classmethod
    def from_arg(cls, spec: str) -> StartBarrier:
        """`DIR:INDEX:PARTIES` (the hidden `--co-tenant-barrier` flag) -> a barrier."""
        directory, index, parties = spec.rsplit(":", 2)
        return cls(directory, int(index), int(parties))

    def wait(self, phase: str) -> None:
        (self.directory / f"{phase}.{self.index}").touch()
        deadline = time.monotonic() + self.timeout_s
        while True:
            if (self.directory / "abort").exists():
                raise RuntimeError(f"co-tenant barrier {phase!r}: another copy failed")
            if len(list(self.directory.glob(f"{phase}.*"))) >= self.parties:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"co-tenant barrier {phase!r}: the other copies did not "
                                   f"arrive within {self.timeout_s:.0f} s")
            time.sleep(0.01)


def strip_co_tenant_flags(argv: list[str]) -> list[str]:
    """`argv` without --co-tenants / --busy-co-tenants / --output-json (and their values)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--co-tenants", "--busy-co-tenants", "--output-json"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _run_copies(bench_argv: list[str], copies: int, busy: int, workdir: Path,
                label: str) -> list[list[dict[str, Any]]]:
    """Run `copies` processes of `pagedllm bench throughput bench_argv` at once, beside `busy`
    busy loops; their results (one list of backend figures per copy).

    Raises:
        RuntimeError: a copy failed (its output's tail in the message).
    """
    barrier_dir = workdir / f"{label}-barrier"
    barrier_dir.mkdir()
    loops = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP]) for _ in range(busy)]
    procs, logs, outs = [], [], []
    try:
        for i in range(copies):
            out = workdir / f"{label}-{i}.json"
            log = open(workdir / f"{label}-{i}.log", "w")
            argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput",
                    *bench_argv, "--output-json", str(out),
                    "--co-tenant-barrier", f"{barrier_dir}:{i}:{copies}"]
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
            outs.append(out)
        failed = []
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0) and i not in failed:
                    failed.append(i)
                    (barrier_dir / "abort").touch()
            time.sleep(0.05)
        failed += [i for i, p in enumerate(procs) if p.returncode != 0 and i not in failed]
    finally:     # (also on Ctrl-C, even a second one: no copy or busy loop outlives the run)
        for proc in [*loops, *procs]:
            if proc.poll() is None:
                proc.kill()
        for proc in [*loops, *procs]:
            try:
                proc.wait(timeout=10)
            except (KeyboardInterrupt, subprocess.TimeoutExpired):
                pass
        for log in logs:
            log.close()
    if failed:
        tail = (workdir / f"{label}-{failed[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"co-tenant copy {failed[0]} ({label}) failed:\n{tail}")
    return [json.loads(out.read_text())["results"] for out in outs]


def run_co_tenants(argv: list[str], copies: int, busy: int,
                   output_json: str | None = None) -> dict[str, Any]:
    """One copy alone, then `copies` at once beside `busy` busy loops; prints and returns the
    report: per backend, the alone figure, each copy's, their sum and sum / alone (output
    tokens/s and total tokens/s).

    Raises:
        ValueError: copies < 1 or busy < 0.
        RuntimeError: a copy failed.
    """
    if copies < 1 or busy < 0:
        raise ValueError(f"--co-tenants must be >= 1 and --busy-co-tenants >= 0, got {copies} "
                         f"and {busy}")
    bench_argv = strip_co_tenant_flags(argv)
    # SIGTERM / SIGHUP end the run as Ctrl-C does: the copies, busy loops and files go too.
    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = ({s: signal.signal(s, _exit_on_signal) for s in handled}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        with tempfile.TemporaryDirectory(prefix="pagedllm-co-tenants-") as tmp:
            alone = _run_copies(bench_argv, 1, 0, Path(tmp), "alone")[0]
            shared = _run_copies(bench_argv, copies, busy, Path(tmp), "shared")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report: dict[str, Any] = {"co_tenants": copies, "busy_co_tenants": busy, "backends": []}
    for b, figures in enumerate(alone):
        row: dict[str, Any] = {"backend": figures["backend"]}
        for key in ("output_tokens_per_s", "total_tokens_per_s"):
            each = [copy[b][key] for copy in shared]
            row[f"alone_{key}"] = figures[key]
            row[f"each_{key}"] = each
            row[f"sum_{key}"] = sum(each)
            row[f"sum_over_alone_{key}"] = sum(each) / figures[key] if figures[key] else None
        row["elapsed_s"] = [figures["elapsed_s"]] + [copy[b]["elapsed_s"] for copy in shared]
        report["backends"].append(row)
    _print_report(report)
    if output_json:
        Path(output_json).write_text(json.dumps(report, indent=2))
        print(f"results saved to {output_json}")
    return report


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _print_report(report: dict[str, Any]) -> None:
    n = report["co_tenants"]
    load = f"{n} copies at once" if n > 1 else "one copy"
    if report["busy_co_tenants"]:
        load += f" beside {report['busy_co_tenants']} busy single-threaded process(es)"
    print(f"==== co-tenants: one copy alone, then {load} ====")
    for row in report["backends"]:
        for key, unit in (("output_tokens_per_s", "output tok/s"),
                          ("total_tokens_per_s", "total tok/s")):
            each = " + ".join(f"{v:.1f}" for v in row[f"each_{key}"])
            ratio = row[f"sum_over_alone_{key}"]
            print(f"{row['backend']:<10} {unit:<13}: alone {row[f'alone_{key}']:.1f}; shared "
                  f"{each} = {row[f'sum_{key}']:.1f} ({ratio:.0%} of alone)"
                  if ratio is not None else f"{row['backend']}: no {unit}")
        if min(row["elapsed_s"]) < MIN_TIMED_RUN_S:
            print(f"warning: {row['backend']}'s shortest timed run took "
                  f"{min(row['elapsed_s']):.3f} s (< {MIN_TIMED_RUN_S:.0f} s): the copies may "
                  "not have overlapped and the figures are noise; give the workload more "
                  "tokens")
