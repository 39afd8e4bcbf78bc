"""`pagedllm bench` flags the fresh-user tryout found accepted: refused before anything runs,
naming the flag (at parse time where one flag alone is wrong, by `check_throughput_flags`
where two disagree), while the documented values still parse."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.benchmarks import cli

TP = ["throughput", "--model", "m"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm")
    cli.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("argv, flag, value, expected", [
    (TP, "--token-low", "-1", "an integer >= 0"),
    (["latency", "--model", "m"], "--token-low", "-5", "an integer >= 0"),
    (["serve"], "--seed", "-1", "an integer >= 0"),
    (TP, "--seed", "-1", "an integer from 0 to 9223372036854775807"),
    (["soak"], "--rss-drift-limit", "-1", "a finite number >= 0"),
    (["soak"], "--rss-drift-limit", "nan", "a finite number >= 0"),
    (["soak"], "--rss-drift-limit", "inf", "a finite number >= 0"),
    (["soak"], "--server-rss-limit-mib", "0", "an integer >= 1"),
    (["soak"], "--server-rss-limit-mib", "-4", "an integer >= 1"),
    (["soak"], "--kv-cache-memory-bytes", "0", "an integer >= 1"),
    (["soak"], "--kv-cache-memory-bytes", "-1048576", "an integer >= 1"),
])
def test_refused_at_parse_naming_the_flag(capsys, argv, flag, value, expected):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["bench", *argv, f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected {expected}, got '{value}'" in err, err


@pytest.mark.parametrize("extra, message", [
    (["--lora-rounds", "2"], "--lora-rounds 2 needs --num-loras"),
    (["--num-loras", "2", "--max-lora-rank", "2", "--lora-rank", "4"],
     "--lora-rank 4 exceeds --max-lora-rank 2"),
    (["--num-loras", "2", "--lora-rank", "32"], "--lora-rank 32 exceeds --max-lora-rank 16"),
])
def test_throughput_flags_that_disagree(extra, message):
    args = _parser().parse_args(["bench", *TP, *extra])
    with pytest.raises(ValueError, match=message):
        cli.check_throughput_flags(args)
    # The command refuses them before it resolves or loads any model.
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_meaningful_values_still_pass():
    parser = _parser()
    for extra in ([], ["--num-loras", "2", "--lora-rounds", "3"],
                  ["--num-loras", "1", "--lora-rank", "8", "--max-lora-rank", "8"],
                  ["--token-low", "0", "--seed", "5"]):
        cli.check_throughput_flags(parser.parse_args(["bench", *TP, *extra]))
    args = parser.parse_args(["bench", "soak", "--rss-drift-limit", "0",
                              "--server-rss-limit-mib", "1", "--kv-cache-memory-bytes", "1"])
    assert (args.rss_drift_limit, args.server_rss_limit_mib, args.kv_cache_memory_bytes) \
        == (0.0, 1, 1)
    assert parser.parse_args(["bench", "serve", "--seed", "0"]).seed == 0


@pytest.mark.parametrize("flag, value, expected", [
    # A negative rate reached random.expovariate (a traceback once a server answered); 0 and
    # nan likewise. inf (all at once, the default) and positive rates pass.
    ("--request-rate", "-1", "a number > 0 (requests/s) or inf"),
    ("--request-rate", "0", "a number > 0 (requests/s) or inf"),
    ("--request-rate", "nan", "a number > 0 (requests/s) or inf"),
    # Without a scheme httpx raised UnsupportedProtocol as a traceback.
    ("--base-url", "localhost:8000", "an http:// or https:// URL"),
])
def test_bench_serve_flags_refused_at_parse(capsys, flag, value, expected):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["bench", "serve", f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected {expected}, got '{value}'" in err, err
    args = _parser().parse_args(["bench", "serve", "--request-rate", "inf", "--request-rate",
                                 "2.5", "--base-url", "https://h:1/"])
    assert (args.request_rate, args.base_url) == (2.5, "https://h:1/")


def test_bench_serve_against_no_server_fails(capsys):
    # Every request failing (nothing listens) printed nan figures and exited 0; with no
    # --model the model lookup raised httpx.ConnectError as a traceback.
    import socket

    from pagedllm.entrypoints.cli import main

    with socket.socket() as s:      # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2",
            "--input-len", "4", "--output-len", "2", "--vocab-size", "50"]
    assert main([*base, "--model", "m"]) == 1
    err = capsys.readouterr().err
    assert "error: all 2 requests failed" in err and "ConnectError" in err, err
    assert main(base) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the server at http://127.0.0.1:{port}"), err
