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
