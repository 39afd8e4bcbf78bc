"""`pagedllm generate` streaming and Ctrl-C, `--max-tokens` refused as the server refuses it, and
the chat-template check that runs before a model loads (issue #40), and a config.json that
transformers refuses reported in one error line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.entrypoints.chat_template_check import has_chat_template
from pagedllm.entrypoints.cli import main
from pagedllm.engine.input_processor import context_length_error
from tests.fixtures.gguf_files import write_gguf

SMALL_KV = ["--kv-cache-memory", str(4 << 20)]


def _texts(out: str) -> list[str]:
    """The generated texts of `generate`'s output (blocks before each separator line)."""
    return [block.strip("\n") for block in out.split("-" * 40 + "\n")[:-1]]


def test_streamed_and_whole_outputs_are_the_same_text(tiny_llama, capsys):
    argv = ["generate", "--model", str(tiny_llama), "--dtype", "float32", *SMALL_KV,
            "--prompt", "Once upon a time", "--prompt", "hello", "--max-tokens", "7",
            "--temperature", "0", "--ignore-eos"]
    assert main([*argv, "--stream"]) == 0
    streamed = capsys.readouterr().out
    assert main([*argv, "--no-stream"]) == 0
    whole = capsys.readouterr().out
    assert _texts(streamed) == _texts(whole)
    assert [t.split("\n")[0][:5] for t in _texts(whole)] == ["Once ", "hello"]
    for out in (streamed, whole):
        assert "generated tokens: 14" in out and "kernel compilation excluded" in out


def test_max_tokens_beyond_the_context_is_refused_with_the_servers_message(tiny_llama,
                                                                           capsys):
    rc = main(["generate", "--model", str(tiny_llama), *SMALL_KV, "--max-model-len", "32",
               "--prompt", "hello", "--max-tokens", "100"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1
    num_prompt_tokens = int(re.search(r"\((\d+) in the prompt", last).group(1))
    assert last == f"error: {context_length_error(32, num_prompt_tokens, 100)}"
    # Without an explicit --max-tokens the default is cut to what the context leaves.
    assert main(["generate", "--model", str(tiny_llama), *SMALL_KV, "--max-model-len", "32",
                 "--prompt", "hello", "--ignore-eos", "--temperature", "0",
                 "--generation-config", "vllm", "--override-generation-config",
                 '{"max_new_tokens": 100}']) == 0
    assert "finish: length" in capsys.readouterr().out


def test_context_length_error_wording():
    assert context_length_error(32, 5, 27) is None and context_length_error(32, 5, None) is None
    assert context_length_error(32, 5, 28) == (
        "This model's maximum context length is 32 tokens. However, you requested 33 tokens "
        "(5 in the prompt, 28 for the completion). Please reduce the length of the prompt or "
        "the completion.")
    assert "requested 32 tokens (32 in the prompt, 0 for" in context_length_error(32, 32, None)


def test_chat_template_presence_is_read_without_loading(tiny_llama, tmp_path):
    with_template = write_gguf(tiny_llama, tmp_path / "with.gguf", "Q8_0")
    without = write_gguf(tiny_llama, tmp_path / "without.gguf", "Q8_0",
                         add_chat_template=False)
    assert has_chat_template(str(with_template)) is True
    assert has_chat_template(str(without)) is False
    assert has_chat_template(str(without), chat_template="{{ messages }}") is True
    assert has_chat_template(str(without), tokenizer=str(tiny_llama)) is True
    assert has_chat_template(str(tiny_llama)) is True
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer_config.json").write_text('{"model_max_length": 16}')
    assert has_chat_template(str(bare)) is False
    assert has_chat_template("some-org/some-model") is None


@pytest.mark.parametrize("command", [["chat"], ["generate", "--chat", "--prompt", "hi"]])
def test_chat_without_a_template_is_refused_before_loading(command, tiny_llama, tmp_path,
                                                           monkeypatch, capsys):
    cache = tmp_path / "views"
    monkeypatch.setenv("PAGEDLLM_GGUF_CACHE", str(cache))
    path = write_gguf(tiny_llama, tmp_path / "without.gguf", "Q8_0", add_chat_template=False)
    assert main([*command, "--model", str(path)]) == 1
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--chat-template FILE" in err
    assert not cache.exists() or not any(cache.iterdir())  # the checkpoint view never built


def _start_generate(args: list[str], env: dict[str, str] | None = None,
                    start_new_session: bool = False) -> subprocess.Popen:
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "PAGEDLLM_CPU_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=start_new_session)


def _read_until(stream, marker: bytes, timeout: float) -> bytes:
    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen and time.monotonic() < deadline:
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    return seen


def test_ctrl_c_while_generating_keeps_the_partial_output(tmp_path):
    """The shipped model streams a long answer; SIGINT after its first tokens ends the command
    with one line and status 130, the text so far on the screen, no traceback."""
    proc = _start_generate(["--prompt", "ROMEO:", "--max-tokens", "1000", "--ignore-eos",
                            "--stream", "--num-scheduler-steps", "1", *SMALL_KV])
    try:
        seen = _read_until(proc.stdout, b"ROMEO:", 120)
        seen += os.read(proc.stdout.fileno(), 4096)      # some generated text too
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    out = (seen + out).decode()
    err = err.decode()
    assert proc.returncode == 130, err[-2000:]
    assert err.rstrip().endswith("^C interrupted") and "Traceback" not in err, err[-2000:]
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:") + 1
    assert "generated tokens" not in out


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_reaches_worker_processes_too(tiny_llama):
    """A terminal sends SIGINT to the whole process group: with -tp 2 the worker processes get
    it too, and must leave the decision to the engine process (no traceback, status 130)."""
    proc = _start_generate(["--model", str(tiny_llama), "-tp", "2", "--prompt", "hi",
                            "--max-tokens", "1000", "--ignore-eos", "--stream",
                            "--num-scheduler-steps", "1", *SMALL_KV], start_new_session=True)
    try:
        _read_until(proc.stdout, b"hi", 120)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"Traceback" not in err and err.rstrip().endswith(b"^C interrupted")


@pytest.mark.slow
def test_ctrl_c_while_loading_exits_130_without_a_traceback():
    proc = _start_generate(["--prompt", "x", *SMALL_KV])
    try:
        _read_until(proc.stderr, b"CPU:", 120)      # the engine has started to build itself
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"Traceback" not in err and err.rstrip().endswith(b"^C interrupted")


@pytest.mark.slow   # a CLI run of its own
def test_start_up_lines_name_the_users_file_and_say_reserved(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0")
    proc = _start_generate(["--model", str(path), *SMALL_KV, "--prompt", "hi", "--max-tokens",
                            "2"], {"PAGEDLLM_GGUF_CACHE": str(tmp_path / "views")})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    lines = err.decode().splitlines()
    ready = [line for line in lines if "engine ready" in line]
    assert len(ready) == 1 and f"model {path}," in ready[0]
    kv = [line for line in lines if "KV cache:" in line]
    assert len(kv) == 1 and "4.0 MiB reserved" in kv[0]


@pytest.mark.parametrize("field, value", [("hidden_size", "64"), ("layer_types", "full")])
def test_invalid_config_field_is_one_error_line(field, value, tiny_llama, tmp_path, capsys):
    # transformers 5 validates config.json with huggingface_hub's strict dataclasses, whose
    # errors are not ValueErrors: they used to reach the terminal as a traceback.
    import json
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(folder), *SMALL_KV, "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "error: invalid model config (config.json): " in err and field in err
    assert "Traceback" not in err

