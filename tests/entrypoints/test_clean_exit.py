"""`pagedllm` commands end with their own output: no screen of nanobind "leaked ..." lines after
it. Those came from triton's extension objects (transformers' model code loads triton through
torch._dynamo) that the engine's `gc.freeze()` kept from the collector until after exit; each
command runs in a subprocess here, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _run_cli(args: list[str], cwd: Path) -> tuple[int, str]:
    """`python -m pagedllm.entrypoints.cli *args`: (exit status, stdout and stderr merged)."""
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc.returncode, proc.stdout


def _last_line(output: str) -> str:
    return output.rstrip().splitlines()[-1]


@pytest.mark.slow
def test_bench_throughput_building_its_preset_exits_cleanly(tmp_path):
    """The preset is built in the process (transformers' LlamaForCausalLM, hence triton) before
    the engine freezes the collector: the case that printed the leak report."""
    rc, output = _run_cli(["bench", "throughput", "--preset", "llama-tiny", "--preset-dir",
                           str(tmp_path / "presets"), "--num-prompts", "2", "--input-len", "8",
                           "--output-len", "2", "--kv-cache-memory-bytes", str(4 << 20)],
                          tmp_path)
    assert rc == 0, output
    assert "leaked" not in output, output[-2000:]
    assert _last_line(output).startswith("machine: "), output[-2000:]


@pytest.mark.slow
def test_verify_exits_cleanly(tiny_llama, tmp_path):
    rc, output = _run_cli(["verify", str(tiny_llama), "--max-tokens", "2", "--num-prompts", "1",
                           "--kv-cache-memory-bytes", str(4 << 20)], tmp_path)
    assert rc == 0, output
    assert "leaked" not in output, output[-2000:]
    assert _last_line(output).startswith("PASS: "), output[-2000:]
