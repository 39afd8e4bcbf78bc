"""The same workload through llama.cpp (llama-cpp-python), when it is installed.

Never a hard dependency: without `llama_cpp`, `llamacpp_unavailable_reason()` says how to install
it and the comparison is skipped. The checkpoint is converted to GGUF with llama.cpp's
`convert_hf_to_gguf.py` (shipped in llama-cpp-python's source distribution under
vendor/llama.cpp/), found via `--llamacpp-converter`, `$PAGEDLLM_LLAMACPP_CONVERTER` or next to the
installed package. `llama_cpp` may live in a separate environment of the same Python version:
$PAGEDLLM_LLAMACPP_SITE_PACKAGES names its site-packages (`use_peer_site_packages`). Sequences
are batched through llama.cpp's low-level `llama_decode` API
(continuous batching over `n_seq_max` slots), so the comparison is batched on both sides.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from pagedllm import envs
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
    "convert_hf_to_gguf.py\n"
    "  (installed in a separate venv of the same Python version: set "
    "PAGEDLLM_LLAMACPP_SITE_PACKAGES=<venv>/lib/pythonX.Y/site-packages)")

_GGUF_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def llamacpp_unavailable_reason() -> str | None:
    """None when `llama_cpp` can be imported (after `use_peer_site_packages()`); else the
    message to print."""
    try:
        use_peer_site_packages()
    except ValueError as e:
        return f"llama.cpp comparison skipped: {e}"
    if importlib.util.find_spec("llama_cpp") is None:
        return INSTALL_HINT
    return None


def check_llamacpp_ready(model_path: str, dtype_name: str, converter: str | None = None) -> None:
    """Refuse `--compare llamacpp` before anything runs when llama.cpp could not: `llama_cpp`
    cannot be imported (from this environment or $PAGEDLLM_LLAMACPP_SITE_PACKAGES), or
    `model_path` is a checkpoint folder with no GGUF conversion in `dtype_name` yet and no
    convert_hf_to_gguf.py to make one (`gguf_for`).

    Raises:
        ValueError: saying which, and how to fix it.
    """
    try:
        site = use_peer_site_packages()
    except ValueError as e:
        raise ValueError(f"--compare llamacpp: {e}") from None
    if importlib.util.find_spec("llama_cpp") is None:
        where = ("PAGEDLLM_LLAMACPP_SITE_PACKAGES is not set" if site is None else
                 f"nor from PAGEDLLM_LLAMACPP_SITE_PACKAGES={site}")
        raise ValueError(f"--compare llamacpp: the `llama_cpp` module (llama-cpp-python) cannot "
                         f"be imported by {sys.executable} ({where}); set "
                         f"PAGEDLLM_LLAMACPP_SITE_PACKAGES to the site-packages of a venv that "
                         f"has it, or install it.\n" + INSTALL_HINT.split("\n", 1)[1])
    if not (model_path.endswith(".gguf") and Path(model_path).is_file()) \
            and not converted_gguf_path(model_path, dtype_name).is_file() \
            and find_converter(converter) is None:
        raise ValueError(str(_converter_missing("--compare llamacpp: ", converter)))


def use_peer_site_packages() -> Path | None:
    """Append $PAGEDLLM_LLAMACPP_SITE_PACKAGES (a separate venv's site-packages holding
    llama-cpp-python, so the engine's own environment stays clean) to the END of `sys.path`:
    modules of this environment keep precedence, only the missing ones (`llama_cpp`, its
    `diskcache`) come from there. Returns the directory, or None when the variable is unset.

    Raises:
        ValueError: the directory does not exist, or it belongs to another Python version
            (`pythonX.Y` in its path differs from this interpreter's: llama_cpp's compiled
            parts and pure-Python dependencies are per version).
    """
    site = envs.get("PAGEDLLM_LLAMACPP_SITE_PACKAGES")
    if site is None:
        return None
    if not site.is_dir():
        raise ValueError(f"PAGEDLLM_LLAMACPP_SITE_PACKAGES={site} is not a directory")
    here = f"python{sys.version_info.major}.{sys.version_info.minor}"
    versions = [p for p in site.resolve().parts if p.startswith("python3")]
    if versions and versions[-1] != here:
        raise ValueError(f"PAGEDLLM_LLAMACPP_SITE_PACKAGES={site} is for {versions[-1]}, this "
                         f"interpreter is {here}")
    if str(site) not in sys.path:
        sys.path.append(str(site))
        importlib.invalidate_caches()
    return site


def find_converter(explicit: str | None = None) -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py: `explicit` (--llamacpp-converter), else
    $PAGEDLLM_LLAMACPP_CONVERTER, else beside the installed llama_cpp package; None if none of
    them is a file."""
    candidates = [explicit, envs.get("PAGEDLLM_LLAMACPP_CONVERTER")]
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


def _converter_missing(what: str, explicit: str | None) -> RuntimeError:
    """The error for a missing converter, naming a --llamacpp-converter path that is not a file."""
    given = f" (--llamacpp-converter {explicit} is not a file)" if explicit else ""
    return RuntimeError(f"{what}convert_hf_to_gguf.py not found{given}.\n"
                        + INSTALL_HINT.split("\n", 1)[1])


def converted_gguf_path(model_path: str, dtype_name: str) -> Path:
    """Where `convert_to_gguf` keeps the checkpoint folder `model_path` converted in
    `dtype_name` (float32 / bfloat16 / float16; any other name converts to f32):
    `<model_path>/model-<outtype>.gguf`. The file may not exist yet."""
    return Path(model_path) / f"model-{_GGUF_OUTTYPES.get(dtype_name, 'f32')}.gguf"


def convert_to_gguf(model_path: str, dtype_name: str, converter: Path) -> Path:
    """`<model_path>/model-<outtype>.gguf`, converted once.

    The converter recognises a byte-level BPE tokenizer only by the hash of known models'
    pre-tokenizers, so a checkpoint with another tokenizer (the synthetic one of `--preset`) is
    converted from a stand-in directory: the same config and weights with a Llama-2-style
    byte-fallback BPE vocabulary of the same size. The benchmark feeds token ids, never text, so
    both engines see the same inputs. A Qwen3-Next checkpoint without MTP tensors (the preset's:
    transformers saves none) trips the converter's MTP count assertion; it is converted again with
    the converter's own `--no-mtp`, which leaves the MTP block out.

    Raises:
        RuntimeError: with the converter's output when it fails.
    """
    outtype = _GGUF_OUTTYPES.get(dtype_name, "f32")
    out = converted_gguf_path(model_path, dtype_name)
    if out.is_file():
        return out
    extra: list[str] = []
    err = _run_converter(converter, Path(model_path), out, outtype)
    if err is not None and _NO_MTP_FAILURE in err:
        extra = ["--no-mtp"]
        err = _run_converter(converter, Path(model_path), out, outtype, extra)
    if err is not None and ("pre-tokenizer was not recognized" in err
                            or "Cannot find Llama BPE tokenizer" in err):
        with tempfile.TemporaryDirectory() as tmp:
            err = _run_converter(converter, _stand_in_vocab_dir(Path(model_path), Path(tmp)),
                                 out, outtype, extra)
    if err is not None:
        raise RuntimeError(f"GGUF conversion failed ({converter}):\n{err[-2000:]}")
    return out


# llama.cpp quantization types `--gguf-type` takes beyond the converter's float outputs (the
# suffix of llama.h's LLAMA_FTYPE_MOSTLY_*).
GGUF_QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_s", "q4_k_m", "q5_k_s",
                    "q5_k_m", "q6_k")


def preset_gguf(model_path: str, gguf_type: str, converter: str | None = None) -> Path:
    """`<model_path>/model-<gguf_type>.gguf`: the checkpoint converted to GGUF (float types:
    f32, bf16, f16) and, for a quantized type (`GGUF_QUANT_TYPES`), quantized from the f32 file
    by llama.cpp's own quantizer (`llama_model_quantize`, as `llama-quantize` does), so pagedllm
    and llama.cpp run the very same file. Built once, then reused.

    Raises:
        ValueError: an unknown type.
        RuntimeError: llama_cpp missing, no converter, or a failed conversion / quantization.
    """
    gguf_type = gguf_type.lower()
    floats = {v: k for k, v in _GGUF_OUTTYPES.items()}
    if gguf_type not in floats and gguf_type not in GGUF_QUANT_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; known: "
                         f"{sorted(floats) + list(GGUF_QUANT_TYPES)}")
    out = (converted_gguf_path(model_path, floats[gguf_type]) if gguf_type in floats
           else Path(model_path) / f"model-{gguf_type}.gguf")
    if out.is_file():           # built before: neither llama.cpp nor its converter needed
        return out
    reason = llamacpp_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason.replace("comparison skipped", "GGUF conversion impossible"))
    found = find_converter(converter)
    if found is None:
        raise _converter_missing("", converter)
    if gguf_type in floats:
        return convert_to_gguf(model_path, floats[gguf_type], found)
    source = convert_to_gguf(model_path, "float32", found)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(),
                                        llama_cpp.byref(params))
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source} -> {gguf_type}) failed with {rc}")
    os.replace(tmp, out)
    return out


# The converter's failure on a Qwen3-Next checkpoint that has no MTP tensors and no
# `mtp_num_hidden_layers` (llama.cpp's conversion/qwen.py, `_QwenMtpMixin.__init__`).
_NO_MTP_FAILURE = "assert self.opt_num_mtp_layers != 0"


def _run_converter(converter: Path, model_dir: Path, out: Path, outtype: str,
                   extra: list[str] | None = None) -> str | None:
    """None on success, else the converter's stderr; `extra`: more converter options."""
    proc = subprocess.run([sys.executable, str(converter), str(model_dir), "--outfile", str(out),
                           "--outtype", outtype, *(extra or [])], capture_output=True, text=True)
    return None if proc.returncode == 0 and out.is_file() else proc.stderr


def _stand_in_vocab_dir(model_dir: Path, tmp: Path) -> Path:
    """`tmp` with links to the checkpoint's config and weights and a Llama-2-style tokenizer
    (BPE with byte fallback: <unk> <s> </s>, the 256 byte tokens, then filler pieces) of the
    config's vocab_size."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    for f in model_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer") \
                and f.name != "special_tokens_map.json":
            (tmp / f.name).symlink_to(f.resolve())
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({f"\u2581p{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "add_bos_token": True, "model_max_length": 4096}))
    return tmp


def run_llamacpp_throughput(model_path: str, requests: list[BenchRequest], dtype_name: str,
                            converter: str | None = None, num_threads: int | None = None,
                            batch_size: int = 32,
                            before_timing: Callable[[], None] | None = None
                            ) -> tuple[dict[str, Any], list[list[int]]]:
    """Greedy, EOS ignored (decoding stops after `output_len` tokens), with up to `batch_size`
    sequences decoded together; `before_timing` is called after the warm-up, just before the
    timed run.

    llama.cpp's own batched API (`llama_decode` over a `llama_batch` whose tokens carry sequence
    ids, as in its `batched` example and llama-server's slots) runs continuous batching: each
    step carries one token for every decoding sequence plus prompt chunks of newly admitted ones,
    up to `n_batch` tokens; a finished sequence's KV is dropped (`llama_memory_seq_rm`) and the
    next request takes its slot. Flash attention on, KV cache in llama.cpp's default f16.

    A `.gguf` model file is run as it is; a checkpoint folder is converted to GGUF in
    `dtype_name` first.

    Raises:
        RuntimeError: llama_cpp missing, no converter found, conversion failed, or a decode
            call failed.
    """
    reason = llamacpp_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    gguf_path = gguf_for(model_path, dtype_name, converter)
    batch_size = max(1, min(batch_size, len(requests)))
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests) + 8
    with PeakRSSMonitor() as mem:
        runner = _BatchedLlamaCpp(str(gguf_path), batch_size, max_len,
                                  num_threads or os.cpu_count() or 1)
        try:
            runner.generate([requests[0].prompt_token_ids[:16]], [4])  # warm-up
            if before_timing is not None:
                before_timing()
            start = time.perf_counter()
            outputs, ttfts = runner.generate([r.prompt_token_ids for r in requests],
                                             [r.output_len for r in requests])
            elapsed = time.perf_counter() - start
        finally:
            runner.close()
    figures = throughput_figures("llama.cpp", requests, outputs, elapsed, mem.peak_bytes)
    figures.update(batch_size=batch_size, gguf=str(gguf_path),
                   **percentiles(ttfts, "ttft_ms", 1e3))
    return figures, outputs


def gguf_for(model_path: str, dtype_name: str, converter: str | None) -> Path:
    """The GGUF file llama.cpp runs for `model_path`: a `.gguf` model file as it is, a
    checkpoint folder converted in `dtype_name` (once).

    Raises:
        RuntimeError: no converter found, or the conversion failed.
    """
    if model_path.endswith(".gguf") and Path(model_path).is_file():
        return Path(model_path)
    converted = converted_gguf_path(model_path, dtype_name)
    if converted.is_file():     # converted before: no converter needed
        return converted
    found = find_converter(converter)
    if found is None:
        raise _converter_missing("llama.cpp comparison skipped: ", converter)
    return convert_to_gguf(model_path, dtype_name, found)


def run_llamacpp_perplexity(model_path: str, windows: list[list[int]], dtype_name: str,
                            converter: str | None = None,
                            num_threads: int | None = None) -> dict[str, Any]:
    """llama.cpp's perplexity over the same token windows `compute_perplexity` scores: each
    window is evaluated from an empty KV cache with logits for every position
    (`Llama(logits_all=True).eval`, flash attention on, f16 KV cache), and token i of a window
    is scored by log_softmax(logits[i - 1])[token i] in float64. Same windows, same tokens, same
    formula, so the two perplexities differ only by the engines' arithmetic.

    Returns:
        {"backend", "gguf", "num_tokens", "num_windows", "mean_nll", "perplexity", "seconds"}.

    Raises:
        RuntimeError: llama_cpp missing, no converter, a failed conversion or evaluation.
    """
    import math

    import numpy as np

    reason = llamacpp_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    gguf_path = gguf_for(model_path, dtype_name, converter)
    import llama_cpp

    window = max(len(w) for w in windows)
    llm = llama_cpp.Llama(str(gguf_path), n_ctx=window, n_batch=window, n_ubatch=window,
                          logits_all=True, n_threads=num_threads or os.cpu_count() or 1,
                          flash_attn=True, verbose=False)
    total, count = 0.0, 0
    start = time.perf_counter()
    try:
        for ids in windows:
            llm.reset()
            llm.eval(ids)
            logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
            top = logits.max(axis=1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
            nll = log_z - logits[np.arange(len(ids) - 1), ids[1:]]
            total += float(nll.sum())
            count += len(ids) - 1
    finally:
        llm.close()
    mean_nll = total / count
    return {"backend": "llama.cpp", "gguf": str(gguf_path), "num_tokens": count,
            "num_windows": len(windows), "mean_nll": mean_nll, "perplexity": math.exp(mean_nll),
            "seconds": time.perf_counter() - start}


def run_llamacpp_latency(model_path: str, requests: list[BenchRequest], batch_size: int,
                         dtype_name: str, converter: str | None = None,
                         num_iters_warmup: int = 1,
                         num_threads: int | None = None) -> dict[str, Any]:
    """`bench latency`'s waves through llama.cpp: `requests` in waves of `batch_size` started
    together (the first `num_iters_warmup` waves untimed), greedy, with TTFT, TPOT (per request:
    (last token time - first token time) / (tokens - 1)), ITL and e2e percentiles as the
    engine's `latency_figures` computes them.

    Raises:
        RuntimeError: llama_cpp missing, no converter, a failed conversion or decode call.
    """
    reason = llamacpp_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    gguf_path = gguf_for(model_path, dtype_name, converter)
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests) + 8
    runner = _BatchedLlamaCpp(str(gguf_path), batch_size, max_len,
                              num_threads or os.cpu_count() or 1)
    ttft, tpot, itl, e2e, waves = [], [], [], [], []
    try:
        for w in range(0, len(requests), batch_size):
            wave = requests[w:w + batch_size]
            times: list[list[float]] = [[] for _ in wave]
            start = time.perf_counter()
            runner.generate([r.prompt_token_ids for r in wave], [r.output_len for r in wave],
                            times)
            if w < num_iters_warmup * batch_size:
                continue
            waves.append(time.perf_counter() - start)
            for t in times:
                ttft.append(t[0] - start)
                e2e.append(t[-1] - start)
                if len(t) > 1:
                    tpot.append((t[-1] - t[0]) / (len(t) - 1))
                itl.extend(b - a for a, b in zip(t, t[1:]))
    finally:
        runner.close()
    return {"backend": "llama.cpp", "gguf": str(gguf_path), "batch_size": batch_size,
            "num_timed_requests": len(ttft), **percentiles(ttft, "ttft_ms", 1e3),
            **percentiles(tpot, "tpot_ms", 1e3), **percentiles(itl, "itl_ms", 1e3),
            **percentiles(e2e, "e2e_latency_ms", 1e3),
            **percentiles(waves, "batch_latency_ms", 1e3)}


_QUIET_LOG = None


def load_llamacpp_model(gguf_path: str):
    """(the `llama_cpp` module, a llama.cpp model loaded from `gguf_path` with default params),
    llama.cpp's logs silenced and its backend initialised. Raises RuntimeError when llama.cpp
    cannot load the file. The caller frees the model (`llama_model_free`)."""
    import llama_cpp as lc

    _silence_llamacpp_logs(lc)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(gguf_path.encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    return lc, model


def new_llamacpp_context(lc, model, *, n_ctx: int, n_batch: int, n_ubatch: int,
                         n_seq_max: int, num_threads: int):
    """A llama.cpp context over `model` (from `load_llamacpp_model`) for the benchmarks: flash
    attention on, perf counters off, `num_threads` for decode and batches; sizes in tokens.
    Raises RuntimeError when llama.cpp cannot create it. The caller frees it (`llama_free`)."""
    params = lc.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch
    params.n_seq_max = n_seq_max
    params.n_threads = params.n_threads_batch = num_threads
    params.flash_attn_type = 1                  # LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.no_perf = True
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    return ctx


def _silence_llamacpp_logs(lc) -> None:
    """llama.cpp logs every load and context to stderr; keep the benchmark's output readable.

    NOTE(llamacpp): llama.cpp keeps the callback's address for the life of the process, so it
    lives at module level: a callback owned by a runner object would be freed with it, and the
    next log line (e.g. `llama_cpp.Llama` loading a model) would call freed memory (a segfault
    seen when the perplexity comparison ran after a throughput comparison in one process).
    """
    global _QUIET_LOG
    if _QUIET_LOG is None:
        _QUIET_LOG = lc.llama_log_callback(lambda level, text, user_data: None)
    lc.llama_log_set(_QUIET_LOG, None)


class _BatchedLlamaCpp:
    """A llama.cpp context with `num_slots` sequences, driven through the low-level API."""

    N_BATCH = 2048  # tokens per llama_decode call

    def __init__(self, gguf_path: str, num_slots: int, max_len: int, num_threads: int) -> None:
        lc, self.model = load_llamacpp_model(gguf_path)
        self.lc = lc
        # n_ctx split evenly between the sequences
        self.ctx = new_llamacpp_context(lc, self.model, n_ctx=num_slots * max_len,
                                        n_batch=self.N_BATCH, n_ubatch=512,
                                        n_seq_max=num_slots, num_threads=num_threads)
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.num_slots = num_slots
        self.batch = lc.llama_batch_init(self.N_BATCH, 0, 1)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def generate(self, prompts: list[list[int]], output_lens: list[int],
                 token_times: list[list[float]] | None = None
                 ) -> tuple[list[list[int]], list[float]]:
        """Greedy tokens per prompt, and each prompt's time to first token (seconds); with
        `token_times`, each prompt's list there gets the `time.perf_counter()` of every token."""
        import numpy as np

        lc, batch = self.lc, self.batch
        start = time.perf_counter()
        outputs: list[list[int]] = [[] for _ in prompts]
        ttfts = [0.0] * len(prompts)
        waiting = list(range(len(prompts)))[::-1]
        slots: list[dict | None] = [None] * self.num_slots   # request, fed (prompt tokens)
        while waiting or any(slots):
            for seq_id in range(self.num_slots):
                if slots[seq_id] is None and waiting:
                    lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                    slots[seq_id] = {"req": waiting.pop(), "fed": 0}
            n, sample_at = 0, []
            for seq_id, slot in enumerate(slots):    # decodes first, then prompt chunks
                if slot is not None and slot["fed"] == len(prompts[slot["req"]]):
                    out = outputs[slot["req"]]
                    self._add(n, out[-1], slot["fed"] + len(out) - 1, seq_id, True)
                    sample_at.append((seq_id, n))
                    n += 1
            for seq_id, slot in enumerate(slots):
                if slot is None or slot["fed"] == len(prompts[slot["req"]]):
                    continue
                prompt = prompts[slot["req"]]
                take = min(len(prompt) - slot["fed"], self.N_BATCH - n)
                for i in range(slot["fed"], slot["fed"] + take):
                    last = i == len(prompt) - 1
                    self._add(n, prompt[i], i, seq_id, last)
                    if last:
                        sample_at.append((seq_id, n))
                    n += 1
                slot["fed"] += take
                if n == self.N_BATCH:
                    break
            batch.n_tokens = n
            if lc.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for seq_id, i in sample_at:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i),
                                               shape=(self.n_vocab,))
                req = slots[seq_id]["req"]
                now = time.perf_counter()
                if not outputs[req]:
                    ttfts[req] = now - start
                if token_times is not None:
                    token_times[req].append(now)
                outputs[req].append(int(logits.argmax()))
                if len(outputs[req]) >= output_lens[req]:
                    slots[seq_id] = None
        return outputs, ttfts

    def _add(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        b = self.batch
        b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = logits
