"""`pagedllm --help` and argument errors must not import torch or transformers (they take
seconds to import); the engine's heavy modules load only when a command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy")

_CHECK = """
import sys
from pagedllm.entrypoints.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
heavy = [m for m in {heavy!r} if m in sys.modules]
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize("argv", [
    ["--help"], ["serve", "--help"], ["bench", "--help"], ["verify", "--help"],
    ["generate", "--help"], ["serve", "--port", "99999"], ["serve", "--model", "/no/such/dir"],
    ["serve", "--enable-auto-tool-choice"],
])
def test_help_and_argument_errors_stay_light(argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-c", _CHECK.format(argv=argv, heavy=HEAVY)],
                            capture_output=True, text=True, timeout=60)
    assert "HEAVY=\n" in result.stdout, (result.stdout[-500:], result.stderr[-2000:])


def test_public_names_still_import() -> None:
    import pagedllm
    from pagedllm import LLM, SamplingParams

    assert pagedllm.LLM is LLM and "SamplingParams" in dir(pagedllm)
    assert SamplingParams(max_tokens=3).max_tokens == 3
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pagedllm.nope  # noqa: B018


def test_a_dead_worker_is_reported_without_a_traceback(monkeypatch, capsys) -> None:
    from pagedllm.entrypoints import cli
    from pagedllm.executor.abstract import WorkerDiedError

    def die(args):
        raise WorkerDiedError("worker rank 1 died (exit code -9)")

    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--prompt", "x"])
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: args)
    args.func = die
    assert cli.main([]) == 1
    assert "error: worker rank 1 died" in capsys.readouterr().err

    def other(args):
        raise RuntimeError("a bug")
    args.func = other
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main([])
