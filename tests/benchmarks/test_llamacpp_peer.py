"""`PAGEDLLM_LLAMACPP_SITE_PACKAGES`: llama-cpp-python from a separate venv's site-packages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pagedllm.benchmarks.llamacpp_baseline import (llamacpp_unavailable_reason,
                                                   use_peer_site_packages)


def test_unset_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", raising=False)
    before = list(sys.path)
    assert use_peer_site_packages() is None
    assert sys.path == before


def test_peer_modules_come_last(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The directory is appended: a module only it has imports from it, one this environment
    has too (pytest) keeps coming from this environment."""
    site = tmp_path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "sp"
    (site / "pagedllm_fake_peer_mod").mkdir(parents=True)
    (site / "pagedllm_fake_peer_mod" / "__init__.py").write_text("X = 7\n")
    (site / "pytest.py").write_text("raise ImportError('peer shadowed this environment')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", str(site))
    assert use_peer_site_packages() == site
    assert sys.path[-1] == str(site)
    use_peer_site_packages()
    assert sys.path.count(str(site)) == 1
    spec = importlib.util.find_spec("pagedllm_fake_peer_mod")
    assert spec is not None and Path(spec.origin).is_relative_to(site)
    assert not Path(importlib.util.find_spec("pytest").origin).is_relative_to(site)


def test_bad_directory_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="PAGEDLLM_LLAMACPP_SITE_PACKAGES=.*missing is not a dir"):
        use_peer_site_packages()
    other = tmp_path / "lib" / "python3.1" / "site-packages"
    other.mkdir(parents=True)
    monkeypatch.setenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", str(other))
    with pytest.raises(ValueError, match="is for python3.1, this interpreter is python3"):
        use_peer_site_packages()
    reason = llamacpp_unavailable_reason()
    assert reason is not None and "python3.1" in reason and str(other) not in sys.path


def test_llamacpp_threads_flag_reaches_the_runner(monkeypatch: pytest.MonkeyPatch):
    """`--llamacpp-threads` is llama.cpp's n_threads; without it the runner picks its default."""
    import argparse

    from pagedllm.benchmarks import cli, llamacpp_baseline

    seen = []
    monkeypatch.setattr(llamacpp_baseline, "run_llamacpp_throughput",
                        lambda *a, num_threads=None, **k: (seen.append(num_threads), None)[1])
    parser = argparse.ArgumentParser()
    cli.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    for extra, want in ((["--llamacpp-threads", "1"], 1), ([], None)):
        args = parser.parse_args(["bench", "throughput", "--model", "m", *extra])
        cli._run_baseline("llamacpp", args, {"model": "m", "dtype": "float32"}, [object()])
        assert seen[-1] == want
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "throughput", "--model", "m", "--llamacpp-threads", "0"])


def test_converter_retried_with_no_mtp(tmp_path: Path):
    """A checkpoint without MTP tensors trips llama.cpp's Qwen3-Next converter; the conversion is
    rerun with its `--no-mtp` (a stand-in converter that fails the same way without it)."""
    from pagedllm.benchmarks.llamacpp_baseline import convert_to_gguf

    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text(
        "import sys\n"
        "if '--no-mtp' not in sys.argv:\n"
        "    sys.exit('    assert self.opt_num_mtp_layers != 0\\nAssertionError')\n"
        "open(sys.argv[sys.argv.index('--outfile') + 1], 'w').write(' '.join(sys.argv[1:]))\n")
    model = tmp_path / "model"
    model.mkdir()
    out = convert_to_gguf(str(model), "float32", converter)
    assert out == model / "model-f32.gguf" and out.read_text().endswith("--outtype f32 --no-mtp")
    other = tmp_path / "other"
    other.mkdir()
    converter.write_text("import sys\nsys.exit('KeyError: some tensor')\n")
    with pytest.raises(RuntimeError, match="(?s)GGUF conversion failed.*KeyError: some tensor"):
        convert_to_gguf(str(other), "float32", converter)


def test_existing_gguf_needs_no_converter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`--compare llamacpp` runs a GGUF file that already exists (a `.gguf` --model, or the
    checkpoint converted before) without looking for llama.cpp's converter; a checkpoint not
    converted yet still names the missing converter."""
    from pagedllm.benchmarks.llamacpp_baseline import gguf_for, preset_gguf

    monkeypatch.delenv("PAGEDLLM_LLAMACPP_CONVERTER", raising=False)
    monkeypatch.delenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", raising=False)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert gguf_for(str(gguf), "float32", None) == gguf
    model = tmp_path / "model"
    model.mkdir()
    if importlib.util.find_spec("llama_cpp") is None:   # else its converter may be found
        with pytest.raises(RuntimeError, match="convert_hf_to_gguf.py not found"):
            gguf_for(str(model), "bfloat16", None)
    for name in ("model-bf16.gguf", "model-f32.gguf", "model-q4_0.gguf"):
        (model / name).write_bytes(b"GGUF")
    assert gguf_for(str(model), "bfloat16", None) == model / "model-bf16.gguf"
    assert gguf_for(str(model), "float32", "/no/such/converter.py") == model / "model-f32.gguf"
    # --preset with --gguf-type: a file built before is reused even without llama.cpp.
    assert preset_gguf(str(model), "Q4_0") == model / "model-q4_0.gguf"
    assert preset_gguf(str(model), "bf16") == model / "model-bf16.gguf"


@pytest.mark.parametrize("command", [["throughput", "--num-prompts", "2"], ["latency"],
                                     ["perplexity"]])
def test_compare_llamacpp_without_llama_cpp_fails_before_the_engine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tiny_llama: Path,
        command: list[str]):
    """`bench ... --compare llamacpp` with `llama_cpp` not importable (here: hidden) stops at
    once with the fix, PAGEDLLM_LLAMACPP_SITE_PACKAGES named, before any engine figure."""
    from pagedllm.entrypoints.cli import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # `import llama_cpp` fails
    monkeypatch.delenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", raising=False)
    assert importlib.util.find_spec("llama_cpp") is None
    status = main(["bench", *command, "--model", str(tiny_llama), "--dtype", "float32",
                   "--compare", "llamacpp"])
    out, err = capsys.readouterr()
    assert status == 1
    assert "PAGEDLLM_LLAMACPP_SITE_PACKAGES is not set" in err and "llama_cpp" in err
    assert "pagedllm" not in out   # no engine figures: the engine never ran


def test_compare_llamacpp_without_converter_fails_before_the_engine(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama: Path):
    """`llama_cpp` importable (a stand-in package from PAGEDLLM_LLAMACPP_SITE_PACKAGES) but a
    checkpoint folder with no conversion and no converter: refused up front, naming the
    converter; a `.gguf` model needs none."""
    from pagedllm.benchmarks.llamacpp_baseline import check_llamacpp_ready

    site = tmp_path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "sp"
    (site / "llama_cpp").mkdir(parents=True)
    (site / "llama_cpp" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", str(site))
    monkeypatch.delenv("PAGEDLLM_LLAMACPP_CONVERTER", raising=False)
    use_peer_site_packages()
    if Path(importlib.util.find_spec("llama_cpp").origin).is_relative_to(site):
        with pytest.raises(ValueError, match="--compare llamacpp: convert_hf_to_gguf.py not "
                                             "found \\(--llamacpp-converter /no/conv.py"):
            check_llamacpp_ready(str(tiny_llama), "float32", "/no/conv.py")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    check_llamacpp_ready(str(gguf), "float32", "/no/conv.py")
    monkeypatch.setenv("PAGEDLLM_LLAMACPP_SITE_PACKAGES", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--compare llamacpp: PAGEDLLM_LLAMACPP_SITE_PACKAGES="):
        check_llamacpp_ready(str(gguf), "float32")
