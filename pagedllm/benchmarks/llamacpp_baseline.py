"""The same workload through llama.cpp (llama-cpp-python), when it is installed.

Never a hard dependency: without `llama_cpp`, `llamacpp_unavailable_reason()` says how to install
it and the comparison is skipped. The checkpoint is converted to GGUF with llama.cpp's
`convert_hf_to_gguf.py` (shipped in llama-cpp-python's source distribution under
vendor/llama.cpp/), found via `--llamacpp-converter`, `$PAGEDLLM_LLAMACPP_CONVERTER` or next to the
installed package. llama-cpp-python's high-level API decodes one sequence at a time, so requests
run sequentially (batch 1): its figures are a batch-1 baseline, not a batched one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report import PeakRSSMonitor, percentiles
from pagedllm.benchmarks.throughput import throughput_figures
from pagedllm.benchmarks.workload import BenchRequest

INSTALL_HINT = (
    "llama.cpp comparison skipped: the `llama_cpp` module (llama-cpp-python) is not installed.\n"
    "  Install it (it compiles llama.cpp, about 10 minutes on a few cores):\n"
    "    CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python\n"
    "  and get the converter from its source distribution:\n"
    "    pip download --no-binary :all: --no-deps llama-cpp-python -d /tmp/lcpp && "
    "tar xf /tmp/lcpp/llama_cpp_python-*.tar.gz -C /tmp/lcpp\n"
    "    pip install gguf sentencepiece\n"
    "  then pass --llamacpp-converter /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp/"
    "convert_hf_to_gguf.py")

_GGUF_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def llamacpp_unavailable_reason() -> str | None:
    """None when `llama_cpp` imports; else the message to print."""
    if importlib.util.find_spec("llama_cpp") is None:
        return INSTALL_HINT
    return None


def find_converter(explicit: str | None = None) -> Path | None:
    candidates = [explicit, os.environ.get("PAGEDLLM_LLAMACPP_CONVERTER")]
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin:
        pkg = Path(spec.origin).parent
        candidates += [str(pkg / "convert_hf_to_gguf.py"),
                       str(pkg / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"),
                       str(pkg.parent / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py")]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


def convert_to_gguf(model_path: str, dtype_name: str, converter: Path) -> Path:
    """`<model_path>/model-<outtype>.gguf`, converted once.

    Raises:
        RuntimeError: with the converter's output when it fails (e.g. a tokenizer it does not
            recognise).
    """
    outtype = _GGUF_OUTTYPES.get(dtype_name, "f32")
    out = Path(model_path) / f"model-{outtype}.gguf"
    if out.is_file():
        return out
    proc = subprocess.run([sys.executable, str(converter), model_path, "--outfile", str(out),
                           "--outtype", outtype], capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"GGUF conversion failed ({converter}):\n{proc.stderr[-2000:]}")
    return out


def run_llamacpp_throughput(model_path: str, requests: list[BenchRequest], dtype_name: str,
                            converter: str | None = None, num_threads: int | None = None
                            ) -> tuple[dict[str, Any], list[list[int]]]:
    """Greedy, EOS ignored (decoding stops after `output_len` tokens), one request at a time.

    Raises:
        RuntimeError: llama_cpp missing, no converter found, or conversion failed.
    """
    reason = llamacpp_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    found = find_converter(converter)
    if found is None:
        raise RuntimeError("llama.cpp comparison skipped: convert_hf_to_gguf.py not found.\n"
                           + INSTALL_HINT.split("\n", 1)[1])
    from llama_cpp import Llama

    gguf_path = convert_to_gguf(model_path, dtype_name, found)
    n_ctx = max(len(r.prompt_token_ids) + r.output_len for r in requests) + 8
    with PeakRSSMonitor() as mem:
        llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=min(n_ctx, 2048),
                    n_threads=num_threads or os.cpu_count(), verbose=False)
        _generate(llm, requests[0].prompt_token_ids[:16], 4)
        outputs, ttfts = [], []
        start = time.perf_counter()
        for r in requests:
            t0 = time.perf_counter()
            tokens, first = _generate(llm, r.prompt_token_ids, r.output_len)
            ttfts.append(first - t0)
            outputs.append(tokens)
        elapsed = time.perf_counter() - start
    figures = throughput_figures("llama.cpp", requests, outputs, elapsed, mem.peak_bytes)
    figures.update(batch_size=1, gguf=str(gguf_path), **percentiles(ttfts, "ttft_ms", 1e3))
    return figures, outputs


def _generate(llm, prompt: list[int], num_tokens: int) -> tuple[list[int], float]:
    tokens: list[int] = []
    first = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                              reset=True):
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(token))
        if len(tokens) >= num_tokens:
            break
    return tokens, first
