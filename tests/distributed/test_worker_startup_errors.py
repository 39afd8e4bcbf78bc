"""Why a tp=2 worker failed must be in the engine's exception: a script read from stdin is refused
before any worker starts, a worker that dies in multiprocessing's bootstrap or in C code has its
last printed lines quoted, and a Python exception in the worker arrives with its traceback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import WorkerDiedError
from tests.distributed.common import ENGINE_ARGS, PROMPTS

_REPO = Path(__file__).resolve().parents[2]


def _run_python(args: list[str], cwd: Path, stdin: str | None = None,
                method: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    env.pop("PAGEDLLM_WORKER_MULTIPROC_METHOD", None)
    if method is not None:
        env["PAGEDLLM_WORKER_MULTIPROC_METHOD"] = method
    return subprocess.run([sys.executable, *args], input=stdin, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _engine_script(path: Path, guarded: bool) -> str:
    """A script that starts a tp=2 engine and prints one line: GENERATED or ERROR with the text."""
    body = textwrap.dedent(f"""\
        try:
            llm = LLM({str(path)!r}, tensor_parallel_size=2, dtype="float32",
                      kv_cache_memory_bytes=1 << 21)
            out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=4, temperature=0),
                               use_tqdm=False)
            print("GENERATED", len(out[0].outputs[0].token_ids))
        except Exception as e:
            if __name__ != "__main__":
                raise  # a worker re-importing this script: its death is under test
            print("ERROR", type(e).__name__, e)
        """)
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    return "from pagedllm import LLM, SamplingParams\n" + body


def test_script_on_stdin_is_refused_before_any_worker_starts(tiny_llama, tmp_path):
    done = _run_python(["-"], tmp_path, stdin=_engine_script(tiny_llama, guarded=True))
    assert "ERROR RuntimeError" in done.stdout, done.stderr[-3000:]
    assert "'<stdin>', which is not a file" in done.stdout
    assert "PAGEDLLM_WORKER_MULTIPROC_METHOD=fork" in done.stdout
    # Refused in the engine process: no worker ran multiprocessing's bootstrap.
    assert "FileNotFoundError" not in done.stderr


def test_script_on_stdin_runs_with_fork(tiny_llama, tmp_path):
    done = _run_python(["-"], tmp_path, stdin=_engine_script(tiny_llama, guarded=True),
                       method="fork")
    assert "GENERATED 4" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.slow
def test_spawn_bootstrap_failure_is_quoted_in_the_error(tiny_llama, tmp_path):
    # Unguarded, each spawned worker runs the script again and multiprocessing refuses to start
    # processes from a bootstrapping one: a failure before any pagedllm code in the worker.
    script = tmp_path / "unguarded.py"
    script.write_text(_engine_script(tiny_llama, guarded=False))
    done = _run_python([str(script)], tmp_path, method="spawn")
    assert "ERROR WorkerDiedError" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "died during start-up with exit code 1" in done.stdout
    assert "What it printed last" in done.stdout
    assert "finished its bootstrapping phase" in done.stdout


@pytest.mark.slow
def test_forkserver_bootstrap_failure_names_the_main_module(tiny_llama, tmp_path):
    # A forkserver worker's bootstrap prints to the server's stderr (not capturable per worker):
    # the error names the likely cause instead.
    script = tmp_path / "unguarded.py"
    script.write_text(_engine_script(tiny_llama, guarded=False))
    done = _run_python([str(script)], tmp_path, method="forkserver")
    assert "ERROR WorkerDiedError" in done.stdout, done.stdout + done.stderr[-3000:]
    assert f"ran the main module (file {script}) again" in done.stdout
    assert 'if __name__ == "__main__":' in done.stdout


def test_worker_exception_traceback_reaches_the_caller(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(WorkerDiedError) as info:
        LLM(str(broken), **ENGINE_ARGS, tensor_parallel_size=2)
    message = str(info.value)
    assert "failed in load_model" in message
    assert "Traceback (most recent call last)" in message
    assert "corrupt checkpoint file" in message


def test_fatal_signal_in_a_worker_quotes_its_faulthandler_dump(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE_ARGS, tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.executor
    try:
        os.kill(executor.worker_pids[1], signal.SIGSEGV)
        with pytest.raises(WorkerDiedError) as info:
            llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    message = str(info.value)
    assert "worker rank 1" in message and f"exit code {-signal.SIGSEGV}" in message
    assert "Fatal Python error: Segmentation fault" in message
