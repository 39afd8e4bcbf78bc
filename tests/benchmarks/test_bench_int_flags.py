"""`pagedllm bench` size flags whose runner reads them as `value or default` (a 0 would silently
become the default) or for which 0 means nothing: the parser refuses values below their least
meaningful one, naming the flag, and still takes the documented ones (`--bandwidth-mib 0`
skips the probe)."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.benchmarks import cli

REFUSED = [
    (["throughput", "--model", "m"], "--hf-batch-size", "0", 1),
    (["throughput", "--model", "m"], "--hf-batch-size", "-3", 1),
    (["throughput", "--model", "m"], "--llamacpp-batch-size", "0", 1),
    (["latency", "--model", "m"], "--bandwidth-mib", "-1", 0),
    (["latency", "--model", "m"], "--profile-steps", "0", 1),
    (["perplexity", "--model", "m"], "--window", "1", 2),
    (["perplexity", "--model", "m"], "--max-windows", "0", 1),
    (["serve"], "--max-concurrency", "0", 1),
    (["serve"], "--vocab-size", "0", 2),
    (["soak"], "--vocab-size", "0", 2),
    (["soak"], "--max-num-seqs", "0", 1),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm")
    cli.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("argv, flag, value, low", REFUSED)
def test_non_positive_sizes_are_refused_naming_the_flag(capsys, argv, flag, value, low):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["bench", *argv, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected an integer >= {low}, got '{value}'" in err, err


def test_meaningful_values_still_parse():
    parser = _parser()
    args = parser.parse_args(["bench", "throughput", "--model", "m", "--hf-batch-size", "1",
                              "--llamacpp-batch-size", "4"])
    assert (args.hf_batch_size, args.llamacpp_batch_size) == (1, 4)
    args = parser.parse_args(["bench", "throughput", "--model", "m"])
    assert (args.hf_batch_size, args.llamacpp_batch_size) == (None, None)
    assert parser.parse_args(["bench", "latency", "--model", "m",
                              "--bandwidth-mib", "0"]).bandwidth_mib == 0
    args = parser.parse_args(["bench", "serve", "--max-concurrency", "1", "--vocab-size", "2"])
    assert (args.max_concurrency, args.vocab_size) == (1, 2)


def test_preset_help_lists_every_preset(capsys):
    """`bench latency --help` names every preset `--preset` accepts (it once named two)."""
    from pagedllm.benchmarks.presets import PRESETS
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "latency", "--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines at hyphens
    for name in PRESETS:
        assert name in out, name
