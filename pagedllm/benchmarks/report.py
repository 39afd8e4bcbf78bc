"""Benchmark figures: percentiles, peak memory, machine facts, printing and JSON output.

A result is a plain dict (JSON-ready); `print_result` renders one as aligned `name: value` lines
and `save_json` writes one or more with the machine facts they were measured on.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float], prefix: str, scale: float = 1.0) -> dict[str, float]:
    """{prefix_mean, prefix_p50, prefix_p90, prefix_p99} of `values` * `scale` (NaN if empty)."""
    arr = np.asarray(values, dtype=np.float64) * scale
    if arr.size == 0:
        return {f"{prefix}_mean": float("nan"),
                **{f"{prefix}_p{p}": float("nan") for p in PERCENTILES}}
    out = {f"{prefix}_mean": float(arr.mean())}
    out.update({f"{prefix}_p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (getrusage; ru_maxrss is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if platform.system() == "Darwin" else peak * 1024)


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return process_peak_rss_bytes()


class PeakRSSMonitor:
    """Peak RSS (absolute, bytes) during a `with` block, sampled every `interval_s` on a thread.

    `getrusage` only knows the process-wide peak, which would charge a baseline that runs later in
    the same process with the engine's earlier peak; this one sees the block only.
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, _current_rss_bytes())

    def __enter__(self) -> PeakRSSMonitor:
        self.peak_bytes = _current_rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, _current_rss_bytes())


def load_average() -> float | None:
    """1-minute load average: how shared the CPU was while a figure was measured."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    import torch

    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu_model, "num_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_avg_1m": load_average(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)


def print_result(result: dict[str, Any], title: str | None = None) -> None:
    """Print the scalar fields of `result` (nested dicts indented, lists summarised)."""
    if title:
        print(f"==== {title} " + "=" * max(0, 60 - len(title)))
    _print_fields(result, indent="")


def _print_fields(fields: dict[str, Any], indent: str) -> None:
    width = max((len(k) for k in fields), default=0)
    for key, value in fields.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print_fields(value, indent + "  ")
        elif isinstance(value, list):
            if value and not isinstance(value[0], (dict, list)) and len(value) <= 8:
                print(f"{indent}{key:<{width}} : {', '.join(_fmt(v) for v in value)}")
        else:
            print(f"{indent}{key:<{width}} : {_fmt(value)}")


def save_json(path: str | Path, results: list[dict[str, Any]],
              args: dict[str, Any] | None = None) -> None:
    """Write {"machine", "args", "results"} to `path` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), "args": args or {}, "results": results}
    path.write_text(json.dumps(payload, indent=2, default=str))
