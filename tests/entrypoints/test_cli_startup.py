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
    ["generate", "--help"], ["chat", "--help"], ["serve", "--port", "99999"],
    ["serve", "--model", "/no/such/dir"],
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


def _walk_parsers(parser, path=()):
    """(command path, parser) for the top-level parser and every (nested) sub-command."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk_parsers(sub, (*path, name))


def test_every_flag_of_every_command_has_help_text() -> None:
    import argparse

    from pagedllm.entrypoints.cli import build_parser

    missing = [(" ".join(path), action.option_strings or action.dest)
               for path, parser in _walk_parsers(build_parser())
               for action in parser._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and not action.help]
    assert missing == []


def test_no_command_accepts_abbreviated_flags() -> None:
    from pagedllm.entrypoints.cli import build_parser

    assert all(not parser.allow_abbrev for _, parser in _walk_parsers(build_parser()))


@pytest.mark.parametrize("argv, usage, hint", [
    (["serve", "--prot", "1"], "pagedllm serve", "did you mean --port?"),
    (["generate", "--prompt", "x", "--max-token", "3"], "pagedllm generate",
     "did you mean --max-tokens?"),
    (["chat", "--temprature", "0"], "pagedllm chat", "did you mean --temperature?"),
    (["bench", "throughput", "--num-prompt", "3"], "pagedllm bench throughput",
     "did you mean --num-prompts?"),
    (["genrate", "--prompt", "x"], "usage: pagedllm ", "did you mean generate?"),
    # A misspelt required flag: argparse reports the missing one first; the hint still comes.
    (["generate", "--promt", "x"], "pagedllm generate",
     "--promt is not a flag: did you mean --prompt?"),
    # A prefix is no longer taken for the flag it starts.
    (["generate", "--prompt", "x", "--max-tok", "3"], "pagedllm generate",
     "unrecognized arguments: --max-tok"),
])
def test_typos_are_reported_by_their_command_with_a_suggestion(argv, usage, hint,
                                                                capsys) -> None:
    from pagedllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert usage in err and hint in err, err
