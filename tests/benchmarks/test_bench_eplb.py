"""Smoke run of `pagedllm bench eplb` (a tiny skewed Mixtral over two mp ranks, ~12 s).

Oracles: the skew the builder aims at is what transformers routes; 2 hot experts of 8 with half
the pairs on 2 ranks make the static placement's imbalance about 4/3 (the hot pair shares rank
0: 0.5 + 2 x 0.5 / 6 of the load); EPLB's predicted imbalance is below it; EPLB on and off give
the same greedy tokens; every decode token is counted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedllm.benchmarks.cli import add_bench_parser

SMALL = ["--hidden-size", "64", "--intermediate-size", "64", "--num-layers", "2",
         "--num-prompts", "4", "--input-len", "8", "--output-len", "16", "--window-size", "4",
         "--step-interval", "4"]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_bench_eplb_off_and_on(tmp_path: Path):
    out = tmp_path / "eplb.json"
    assert _run(["bench", "eplb", *SMALL, "--output-json", str(out)]) == 0
    off, on = json.loads(out.read_text())["results"]
    assert off["backend"] == "eplb_off" and on["backend"] == "eplb_on"
    for r in (off, on):
        assert r["decode_tokens"] == 4 * (16 - 1) and r["decode_tokens_per_s"] > 0
    assert "num_rebalances" not in off
    assert on["num_rebalances"] >= 2
    assert on["setup"]["hot_share_measured"] == pytest.approx(0.5, abs=0.02)
    # About 4/3; the first window holds only ~80 tokens per layer, so the cold experts' share
    # on rank 0 varies. Without the skew, two ranks sit near 1.
    assert 1.2 < on["imbalance_static_placement"] < 1.5
    assert on["imbalance_after_last_rebalance_predicted"] < on["imbalance_static_placement"]
    assert on["comparison"]["same_greedy_tokens"] is True
    assert on["comparison"]["decode_tokens_per_s_ratio_on_off"] > 0


@pytest.mark.parametrize("flag, value, message", [
    ("--hot-share", "1.5", "--hot-share"),
    ("--num-hot-experts", "8", "--num-hot-experts"),
    ("--hidden-size", "48", "multiple of 32"),
])
def test_bench_eplb_refuses_bad_flags(flag, value, message):
    with pytest.raises(ValueError, match=message):
        _run(["bench", "eplb", flag, value])
