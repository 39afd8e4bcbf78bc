"""Summarise and plot one sitting of `scripts/bench_sitting.sh` (needs matplotlib: `bench` extra).

    python docs/plot_scaling.py docs/results/sitting -o docs/scaling.png \
        --quantized docs/quantized.png

Prints a markdown table per group of results (pagedllm against each peer in the same run, with
the ratio; prompts of 4k tokens or more get a TTFT row too) and draws two panels: output tokens/s against batch size (`s_batch*.json`, 128 -> 64
tokens) and decode time per token against context length (`s_ctx*.json`, `f_ctx*_bs1.json`),
one line per engine; with --quantized, bars per GGUF file (batch 1 and 32 x 128) for
pagedllm and llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["results"]


def _by_backend(results: list[dict]) -> dict[str, dict]:
    return {r.get("backend", "?"): r for r in results if "backend" in r}


def table(folder: Path) -> str:
    """Markdown rows: workload, pagedllm figure, each peer's, ratio (> 1: pagedllm ahead)."""
    rows = ["| run | figure | pagedllm | HF | llama.cpp | vs HF | vs llama.cpp |",
            "|---|---|---|---|---|---|---|"]
    for path in sorted(folder.glob("*.json")):
        results = _results(path)
        engines = _by_backend(results)
        ours = engines.get("pagedllm")
        if ours is None:
            if "perplexity" in results[0]:
                rows.append(f"| {path.stem} | perplexity | {results[0]['perplexity']:.3f} | - | "
                            + (f"{results[1]['perplexity']:.3f} | - | "
                               f"{results[0]['perplexity'] / results[1]['perplexity']:.4f} |"
                               if len(results) > 1 else "- | - | - |"))
            continue
        if "tpot_ms_mean" in ours:
            figure, key, better = "TPOT ms", "tpot_ms_mean", "lower"
        elif ours["num_output_tokens"] == ours["num_requests"]:   # a prefill run
            figure, key, better = "total tok/s", "total_tokens_per_s", "higher"
        else:
            figure, key, better = "output tok/s", "output_tokens_per_s", "higher"
        rows.append(_row(path.stem, figure, engines, key, better))
        # Long prompts: their prefill time too.
        if "ttft_ms_mean" in ours and _input_len(path) >= LONG_PROMPT_TOKENS:
            rows.append(_row(path.stem, "TTFT ms", engines, "ttft_ms_mean", "lower"))
    return "\n".join(rows)


# Latency runs with prompts at least this long also get a TTFT row.
LONG_PROMPT_TOKENS = 4096


def _input_len(path: Path) -> int:
    return int(json.loads(path.read_text())["args"].get("input_len") or 0)


def _row(name: str, figure: str, engines: dict[str, dict], key: str, better: str) -> str:
    """One table row: pagedllm's figure `key`, each peer's, and the ratios."""
    ours = engines["pagedllm"]
    cells = [f"{ours[key]:.4g}"]
    ratios = []
    for peer in ("hf", "llama.cpp"):
        theirs = engines.get(peer)
        if theirs is None or key not in theirs:
            cells.append("-")
            ratios.append("-")
            continue
        cells.append(f"{theirs[key]:.4g}")
        ratio = theirs[key] / ours[key] if better == "lower" else ours[key] / theirs[key]
        ratios.append(f"{ratio:.2f}x")
    return f"| {name} | {figure} | " + " | ".join(cells + ratios) + " |"


def _series(folder: Path, pattern: str, key: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for path in folder.glob("*.json"):
        match = re.fullmatch(pattern, path.stem)
        if not match:
            continue
        x = int(match.group(1)) * (1024 if match.group(0).endswith("k_bs1") else 1)
        for backend, result in _by_backend(_results(path)).items():
            if key in result:
                series.setdefault(backend, []).append((x, result[key]))
    return {b: sorted(points) for b, points in series.items()}


def plot(folder: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend, points in _series(folder, r"s_batch(\d+)", "output_tokens_per_s").items():
        left.plot(*zip(*points), marker="o", label=backend)
    left.set(xscale="log", xlabel="batch size (requests of 128 -> 64 tokens)",
             ylabel="output tokens/s", title="throughput against batch size")
    ctx = _series(folder, r"s_ctx(\d+)", "tpot_ms_mean")
    for backend, points in _series(folder, r"f_ctx(\d+)k_bs1", "tpot_ms_mean").items():
        ctx.setdefault(backend, []).extend(points)
    for backend, points in ctx.items():
        right.plot(*zip(*sorted(points)), marker="o", label=backend)
    right.set(xscale="log", xlabel="context length (tokens)", ylabel="decode ms per token (TPOT)",
              title="batch-1 decode against context")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_quantized(folder: Path, out: Path) -> Path:
    """Bars per GGUF file (`q_<file>_batch1.json`, `q_<file>_32x128.json`): batch-1 decode
    tokens/s (1000 / TPOT) and 32 x (128 -> 128) output tokens/s, pagedllm and llama.cpp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({p.stem[2:].rsplit("_", 1)[0] for p in folder.glob("q_*_batch1.json")})
    panels = (("batch1", "tpot_ms_mean", "batch-1 decode tokens/s (1000 / TPOT)"),
              ("32x128", "output_tokens_per_s", "32 x (128 -> 128) output tokens/s"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (suffix, key, title) in zip(axes, panels):
        for k, backend in enumerate(("pagedllm", "llama.cpp")):
            values = []
            for name in names:
                path = folder / f"q_{name}_{suffix}.json"
                result = _by_backend(_results(path)).get(backend, {}) if path.exists() else {}
                value = result.get(key, 0.0)
                values.append(1000.0 / value if key == "tpot_ms_mean" and value else value)
            ax.bar([i + 0.4 * k for i in range(len(names))], values, width=0.4, label=backend)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=15)
        ax.set(title=title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG to write")
    parser.add_argument("--quantized", type=Path, default=None,
                        help="PNG of the GGUF runs (q_*) to write")
    args = parser.parse_args()
    print(table(args.folder))
    if args.output is not None:
        print(f"wrote {plot(args.folder, args.output)}")
    if args.quantized is not None:
        print(f"wrote {plot_quantized(args.folder, args.quantized)}")


if __name__ == "__main__":
    main()
