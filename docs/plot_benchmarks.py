"""Plot `pagedllm bench ... --output-json` results as one PNG (needs matplotlib: the `bench` extra).

    python docs/plot_benchmarks.py results/*.json -o docs/benchmarks.png

Throughput results become grouped bars of output tokens/s, one group per JSON file (workload) and
one colour per backend; latency and serve results become grouped bars of TTFT and TPOT at
p50/p90/p99.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _label(path: Path, result: dict) -> str:
    return f"{path.stem}:{result.get('backend', '?')}"


def load(paths: list[Path]) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(throughput-like results, latency-like results) as (label, result) pairs."""
    throughput, latency = [], []
    for path in paths:
        for result in json.loads(path.read_text())["results"]:
            label = _label(path, result)
            if "tpot_ms_p50" in result:
                latency.append((label, result))
            if "output_tokens_per_s" in result:
                throughput.append((label, result))
    return throughput, latency


def plot(paths: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput, latency = load(paths)
    ncols = (1 if throughput else 0) + (2 if latency else 0)
    if ncols == 0:
        raise ValueError("no throughput or latency results in the given files")
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5), squeeze=False)
    axes = list(axes[0])
    if throughput:
        ax = axes.pop(0)
        groups = list(dict.fromkeys(lbl.split(":", 1)[0] for lbl, _ in throughput))
        backends = list(dict.fromkeys(r.get("backend", "?") for _, r in throughput))
        width = 0.8 / len(backends)
        for i, backend in enumerate(backends):
            xs, values = [], []
            for j, group in enumerate(groups):
                for lbl, r in throughput:
                    if lbl == f"{group}:{backend}":
                        xs.append(j + i * width)
                        values.append(r["output_tokens_per_s"])
            bars = ax.bar(xs, values, width, label=backend)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.margins(y=0.12)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=20,
                      ha="right")
        ax.set_ylabel("output tokens/s")
        ax.set_title("throughput (higher is better)")
        ax.legend(fontsize=8)
    for metric in ("ttft", "tpot") if latency else ():
        ax = axes.pop(0)
        width = 0.8 / len(latency)
        for i, (lbl, r) in enumerate(latency):
            xs = [j + i * width for j in range(3)]
            ax.bar(xs, [r[f"{metric}_ms_p{p}"] for p in (50, 90, 99)], width, label=lbl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(3)], ["p50", "p90", "p99"])
        ax.set_ylabel("ms")
        ax.set_title(f"{metric.upper()} (lower is better)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="JSON files from --output-json")
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks.png"))
    args = parser.parse_args(argv)
    try:
        print(plot(args.results, args.output))
    except ImportError:
        print("matplotlib is needed: pip install 'pagedllm[bench]'", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
