"""`pagedllm chat` in a real terminal (tmux): tokens stream before an answer ends, Ctrl-C stops
an answer and keeps the conversation, the next turn reuses the cached prefix, Ctrl-D leaves with
status 0 and no traceback (issue #40). Also the session's commands, without a terminal."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest


TMUX = shutil.which("tmux")
REPO = Path(__file__).parents[2]
SUMMARY = re.compile(r"^\[(\d+) tokens in [\d.]+ s, [\d.]+ tokens/s \(prompt included\); prompt "
                     r"(\d+) tokens, cached_tokens (\d+); finish: (\w+)\]$", re.M)


class Terminal:
    """A tmux session of its own server (socket), 200 x 50, running one command."""

    def __init__(self, command: str, tag: str) -> None:
        self.base = [TMUX, "-L", f"pagedllm-test-{os.getpid()}-{tag}"]
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}
        subprocess.run([*self.base, "new-session", "-d", "-s", "t", "-x", "200", "-y", "50",
                        command], check=True, env=env, timeout=30)

    def screen(self) -> str:
        """The pane's text, history included, wrapped lines joined."""
        return subprocess.run([*self.base, "capture-pane", "-p", "-J", "-S", "-", "-t", "t"],
                              capture_output=True, text=True, timeout=30).stdout

    def send(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "t", *keys], check=True, timeout=30)

    def wait(self, condition: Callable[[str], bool], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if condition(screen):
                return screen
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)


def _answer(screen: str, question: str) -> str:
    """The text printed after `question` was entered, up to its summary line if any."""
    after = screen.split(f">>> {question}\n", 1)[1] if f">>> {question}\n" in screen else ""
    return SUMMARY.split(after)[0].replace("^C interrupted", "").strip()


def _summaries(screen: str) -> list[tuple[int, int, int, str]]:
    return [(int(n), int(p), int(c), finish) for n, p, c, finish in SUMMARY.findall(screen)]


@pytest.mark.slow
@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_chat_in_a_terminal_streams_stops_on_ctrl_c_and_reuses_the_prefix():
    # NOTE(speed): the portable torch paths (PAGEDLLM_CPU_KERNELS=0) need no kernel build and
    # make a 150-token answer of the shipped model take seconds, long enough to watch it
    # grow and to interrupt it.
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PAGEDLLM_CPU_KERNELS": "0"}
    chat = [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--temperature", "0",
            "--max-tokens", "150", "--ignore-eos", "--kv-cache-memory", str(16 << 20)]
    assignments = shlex.join(f"{k}={v}" for k, v in env.items())
    command = (f"cd {shlex.quote(str(REPO))} && env {assignments} {shlex.join(chat)}; "
               f"echo EXIT=$?; sleep 60")
    term = Terminal(command, "chat")
    try:
        term.wait(lambda s: s.rstrip().endswith(">>>"), 120, "the first prompt")

        term.send("Good morrow, my lord.", "Enter")
        growing = term.wait(lambda s: len(_answer(s, "Good morrow, my lord.")) > 0, 30,
                            "the first tokens")
        assert _summaries(growing) == [], "the whole answer came at once"
        first = _answer(growing, "Good morrow, my lord.")
        screen = term.wait(lambda s: len(_summaries(s)) == 1, 60, "the first summary")
        assert _summaries(screen)[0][0] == 150 and _summaries(screen)[0][3] == "length"
        # Part of the answer was on the screen before the rest of it was generated.
        assert len(first) < len(_answer(screen, "Good morrow, my lord."))

        term.send("What news from the court?", "Enter")
        term.wait(lambda s: len(_answer(s, "What news from the court?")) > 10, 30,
                  "the second answer")
        term.send("C-c")
        screen = term.wait(lambda s: len(_summaries(s)) == 2, 30, "the second summary")
        assert "^C interrupted" in screen
        n2, p2, _, finish2 = _summaries(screen)[1]
        assert finish2 == "abort" and 0 < n2 < 150
        partial = _answer(screen, "What news from the court?")

        term.send("Speak again.", "Enter")
        screen = term.wait(lambda s: len(_summaries(s)) == 3, 60, "the third summary")
        _, p3, cached3, _ = _summaries(screen)[2]
        # The partial answer stayed in the conversation, and the earlier turns came from the
        # prefix cache.
        assert p3 > p2 + n2 // 2 and partial
        assert cached3 > p2 // 2, screen

        term.send("C-d")
        screen = term.wait(lambda s: "EXIT=" in s, 30, "the exit status")
        assert "EXIT=0" in screen and "Traceback" not in screen, screen
    finally:
        term.close()


def test_chat_commands_from_a_pipe(tiny_llama):
    """/system, /reset, an unknown command, /exit; the lines after /exit are never read."""
    lines = "/system You are terse.\nhello\n/reset\n/nope\nhi\n/exit\nnever\n"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--model", str(tiny_llama),
         "--kv-cache-memory", str(4 << 20), "--max-tokens", "3", "--ignore-eos",
         "--temperature", "0"], input=lines, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                          os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "(system message set, conversation cleared)" in out
    assert "(conversation cleared)" in out and "unknown command /nope" in out
    summaries = _summaries(out)
    assert [n for n, *_ in summaries] == [3, 3]
    # After /reset the second turn is a new conversation, still with the system message.
    assert summaries[1][1] < summaries[0][1] + 3
