"""`pagedllm serve` refuses bad flags before anything loads: argparse types (exit status 2) and
`check_serve_args` (exit status 1 through the CLI), each with one `error:` line and no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import build_parser, main as cli_main
from pagedllm.entrypoints.openai.cli_args import check_can_listen, check_serve_args

_REPO = Path(__file__).resolve().parents[2]


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


@pytest.fixture
def busy_port():
    """A loopback port with a listening socket on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "argument --port: expected an integer from 0 to 65535, got '99999'"),
    (["--port", "-1"], "argument --port: expected an integer from 0 to 65535"),
    (["--port", "eighty"], "argument --port: expected an integer from 0 to 65535"),
    (["--host", ""], "argument --host: must not be empty"),
    (["--api-key", ""], "argument --api-key: must not be empty"),
    (["--api-key", "key "], "argument --api-key: must not start or end with whitespace"),
    (["--served-model-name", "a", " "], "argument --served-model-name: must not be empty"),
    (["--data-parallel-size", "0"], "argument --data-parallel-size/-dp: expected an integer >= 1"),
    (["--max-request-body-bytes", "0"], "argument --max-request-body-bytes: expected an integer"),
    (["--master-port", "70000"], "argument --master-port: expected an integer from 1 to 65535"),
])
def test_argparse_refuses_with_one_error_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _serve_args(*flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("pagedllm serve: error: "), err
    assert message in errors[0]
    assert "Traceback" not in err
    assert len(err.splitlines()) == 2  # the short usage line, then the error


def test_valid_flags_parse():
    args = _serve_args("--port", "0", "--api-key", "k", "--served-model-name", "a", "b",
                       "-dp", "2", "--master-port", "29500")
    assert (args.port, args.api_key, args.served_model_name) == (0, "k", ["a", "b"])
    assert (args.data_parallel_size, args.master_port) == (2, 29500)


@pytest.mark.parametrize("flags, error, message", [
    (["--pooling-type", "MEAN"], ValueError, "--pooling-type needs --runner pooling"),
    (["--runner", "pooling", "-dp", "2"], ValueError,
     "--data-parallel-size > 1 is not supported with --runner pooling"),
    (["-dp", "2", "--kv-transfer-config",
      '{"kv_connector": "P2pShmConnector", "kv_role": "kv_producer"}'], ValueError,
     "--data-parallel-size > 1 is not supported with P2pShmConnector"),
    (["--model", "./no/such/dir"], FileNotFoundError, "--model ./no/such/dir: no such folder"),
    (["--model", "/no/such/dir"], FileNotFoundError, "--model /no/such/dir: no such folder"),
    (["--tokenizer", "../nowhere"], FileNotFoundError, "--tokenizer ../nowhere: no such folder"),
    # Accepted, so every file: image URL later failed as "outside --allowed-local-media-path".
    (["--allowed-local-media-path", "/no/such/dir"], FileNotFoundError,
     "--allowed-local-media-path /no/such/dir: no such folder"),
    (["--host", "no-such-host.invalid"], ValueError,
     "cannot listen on no-such-host.invalid:8000: host 'no-such-host.invalid' does not resolve"),
    (["--host", "192.0.2.1", "--port", "0"], ValueError,
     "cannot listen on 192.0.2.1:0: .* \\(not an address of this machine\\)"),
])
def test_check_serve_args_refuses(flags, error, message):
    with pytest.raises(error, match=message):
        check_serve_args(_serve_args(*flags))


def test_model_file_is_not_a_folder(tiny_llama):
    config = str(tiny_llama / "config.json")
    with pytest.raises(FileNotFoundError, match="is a file, not a checkpoint folder"):
        check_serve_args(_serve_args("--model", config))


def test_check_serve_args_accepts_a_folder_and_a_hub_id(tiny_llama):
    check_serve_args(_serve_args("--model", str(tiny_llama), "--port", "0"))
    check_serve_args(_serve_args("--model", str(tiny_llama), "--port", "0",
                                 "--allowed-local-media-path", str(tiny_llama)))
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        check_serve_args(_serve_args("--model", str(tiny_llama), "--port", "0",
                                     "--allowed-local-media-path",
                                     str(tiny_llama / "config.json")))
    # A hub id is the engine's to resolve (it may download): not checked here.
    check_serve_args(_serve_args("--model", "org/name", "--port", "0"))


def test_busy_port_is_refused(busy_port):
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{busy_port}: "
                                         f"Address already in use"):
        check_can_listen("127.0.0.1", busy_port)
    with pytest.raises(ValueError, match=f"cannot listen on localhost:{busy_port}"):
        check_can_listen("localhost", busy_port)
    check_can_listen("127.0.0.1", 0)


def test_cli_prints_one_error_line_and_returns_1(busy_port, tiny_llama, capsys):
    assert cli_main(["serve", "--model", str(tiny_llama), "--port", str(busy_port)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: cannot listen on 127.0.0.1:{busy_port}: Address already in use\n"


@pytest.mark.parametrize("flags, status, error", [
    (["--port", "99999"], 2,
     "pagedllm serve: error: argument --port: expected an integer from 0 to 65535, got '99999'"),
    (["--model", "./no/such/folder"], 1, "error: --model ./no/such/folder: no such folder"),
], ids=["port", "model"])
def test_serve_subprocess_fails_fast_without_traceback(flags, status, error, tmp_path):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *flags],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(_REPO)),
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 20
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if "error" in line.lower()] == [error]


@pytest.mark.parametrize("flags", [["--api-server-count", "2", "-dp", "2"],
                                   ["-asc", "3", "-dp", "1"]])
def test_several_api_servers_with_ray_replicas_refused(tiny_llama, flags, capsys):
    """`--api-server-count N>1` with `--data-parallel-backend ray` is refused before anything
    starts (the API servers reach the engine cores over IPC sockets, which a core on another
    Ray node cannot serve): one error line naming both flags, status 1; each flag alone
    passes the check."""
    model = ["--model", str(tiny_llama), "--port", "0"]
    with pytest.raises(ValueError, match="--api-server-count > 1 is not supported with "
                                         "--data-parallel-backend ray"):
        check_serve_args(_serve_args(*model, *flags, "--data-parallel-backend", "ray"))
    assert cli_main(["serve", *model, *flags, "-dpb", "ray"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: --api-server-count > 1 is not supported with --data-parallel-backend "
                   "ray (the engine cores' sockets are IPC)\n"), err
    check_serve_args(_serve_args(*model, *flags))
    check_serve_args(_serve_args(*model, "-dp", "2", "--data-parallel-backend", "ray"))
