"""docs/plot_benchmarks.py turns saved results into a PNG (skipped without matplotlib)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

_SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "plot_benchmarks.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("plot_benchmarks", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_and_latency_results_plot(tmp_path: Path):
    plot = _load_script()
    tp = tmp_path / "a.json"
    tp.write_text(json.dumps({"results": [
        {"backend": "pagedllm", "output_tokens_per_s": 10.0},
        {"backend": "llama.cpp", "output_tokens_per_s": 8.0, "ttft_ms_p50": 5.0},
        {"backend": "hf", "output_tokens_per_s": 2.0}]}))
    lat = tmp_path / "b.json"
    lat.write_text(json.dumps({"results": [{"backend": "pagedllm", **{
        f"{m}_ms_p{p}": 1.0 + p for m in ("ttft", "tpot") for p in (50, 90, 99)}}]}))
    throughput, latency = plot.load([tp, lat])
    assert [lbl for lbl, _ in throughput] == ["a:pagedllm", "a:llama.cpp", "a:hf"]
    assert [lbl for lbl, _ in latency] == ["b:pagedllm"]   # a TTFT alone is not a latency run
    out = plot.plot([tp, lat], tmp_path / "out.png")
    assert out.stat().st_size > 0
