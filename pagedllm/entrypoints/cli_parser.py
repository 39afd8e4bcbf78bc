"""The argument parser class of every `pagedllm` command and sub-command.

Two habits of argparse work against a command line with many long flags: prefixes of flags are
accepted (`--max` would silently mean `--max-tokens` until a `--max-model-len` appears), and an
unknown flag of a sub-command is reported by the top-level parser with the top-level usage and no
hint. `CLIArgumentParser` turns prefixes off, reports unknown flags from the sub-command that saw
them, and suggests the closest known flag or command ("did you mean --port?"; Python 3.14's
`suggest_on_error` does the same for choices only). It imports nothing heavy.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

_UNRECOGNIZED = "unrecognized arguments: "
_REQUIRED = "the following arguments are required: "
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class CLIArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with `allow_abbrev=False` by default, unknown arguments refused
    by the (sub-)parser that received them, and "did you mean" hints in its errors.

    Sub-parsers made through `add_subparsers` are of this class too (argparse makes them of the
    parent's class). Errors exit with status 2, as argparse's do.
    """

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, but leftover arguments are an error of this parser: a sub-command
        then reports them with its own usage and flags to suggest."""
        # Kept for error(): argparse reports a missing required flag before unknown ones, and a
        # misspelt required flag (`--promt`) is both.
        self._given_args = list(args) if args is not None else None
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(_UNRECOGNIZED + " ".join(extras))
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        """Print usage and `message` plus a suggestion where one is close; exit with status 2."""
        hint = self._suggestion(message)
        super().error(message + (f" ({hint})" if hint else ""))

    def _suggestion(self, message: str) -> str | None:
        flags = [s for s in self._option_string_actions if s.startswith("--")]
        if message.startswith(_UNRECOGNIZED):
            close = _closest_flag(message[len(_UNRECOGNIZED):].split(), flags)
            return close and f"did you mean {close[1]}?"
        if message.startswith(_REQUIRED):
            unknown = [w for w in getattr(self, "_given_args", None) or ()
                       if w.split("=", 1)[0] not in self._option_string_actions]
            close = _closest_flag(unknown, flags)
            return close and f"{close[0]} is not a flag: did you mean {close[1]}?"
        match = _INVALID_CHOICE.search(message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2))
            close = difflib.get_close_matches(match.group(1), choices, n=1)
            return f"did you mean {close[0]}?" if close else None
        return None


def _closest_flag(words: list[str], flags: list[str]) -> tuple[str, str] | None:
    """(word, known flag) for the first of `words` that looks like a misspelt flag."""
    for word in words:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1)
            if close:
                return word.split("=", 1)[0], close[0]
    return None
