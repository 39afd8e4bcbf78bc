"""Native CPU kernels, compiled on first use with the system C++ compiler and loaded with ctypes.

The sources live in `csrc/`. `cpu_kernels()` compiles them once per (source, compiler flags, CPU
flags) into a cache directory (`$PAGEDLLM_KERNEL_CACHE`, default `~/.cache/pagedllm/kernels`) and
returns the loaded library, or None when they cannot be used (no compiler, a failed build, or
`PAGEDLLM_CPU_KERNELS` set to 0/false/off/no); callers then fall back to torch ops. Building
needs only g++ with OpenMP (no torch headers; `$CXX` picks another compiler), one compiler
process per source and usable core, then one link; the library shares the OpenMP runtime torch
loaded.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from pagedllm import envs
from pagedllm.native.kernels import abi

logger = logging.getLogger(__name__)

_SOURCES = ("cpu_attention.cpp", "cpu_linear.cpp", "cpu_decoder.cpp", "cpu_gguf_linear.cpp",
            "cpu_int8_linear.cpp", "cpu_fused_moe.cpp", "cpu_gguf_q8_linear.cpp",
            "cpu_packed_gemm.cpp", "cpu_decode_loop.cpp", "cpu_lora.cpp",
            "cpu_state_scan.cpp", "cpu_dsa.cpp", "cpu_mla_decoder.cpp",
            "cpu_gdn_decoder.cpp", "cpu_moe_block.cpp", "cpu_hybrid_stack.cpp",
            "cpu_mla_prefill.cpp")
_CXXFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

_lock = threading.Lock()
_NOT_LOADED = object()
_library: ctypes.CDLL | None | object = _NOT_LOADED


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _key_files(csrc: Path) -> list[Path]:
    """The files whose contents key a build: the sources, then every header in `csrc` (all of
    them, so a header added or split out later is part of the key without being listed)."""
    return [csrc / s for s in _SOURCES] + sorted(csrc.glob("*.h"))


def _cache_dir() -> Path:
    root = envs.get("PAGEDLLM_KERNEL_CACHE")
    return root if root is not None else Path.home() / ".cache" / "pagedllm" / "kernels"


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile the sources into `target`, atomically (concurrent processes may race here)."""
    csrc = Path(__file__).parent / "csrc"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if target.exists():
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            (Path(tmp) / "pagedllm_abi.h").write_text(abi.c_header())
            # One object per source, compiled by as many processes as this process may use
            # cores, then one link.
            compile_flags = [f for f in flags if f != "-shared"]
            objects = [Path(tmp) / f"{Path(s).stem}.o" for s in _SOURCES]
            jobs = [[compiler, *compile_flags, f"-I{tmp}", "-c", str(csrc / s), "-o", str(o)]
                    for s, o in zip(_SOURCES, objects)]
            _run_all(jobs, max(1, len(os.sched_getaffinity(0))))
            _run_all([[compiler, *flags, *map(str, objects), "-o", str(out)]], 1)
            os.replace(out, target)


def _run_all(commands: list[list[str]], parallel: int) -> None:
    """Run `commands`, at most `parallel` at a time. Raises RuntimeError naming the first that
    fails, with the end of its stderr (the others are waited for)."""
    pending, running, failed = list(commands), [], None
    while pending or running:
        while pending and len(running) < parallel:
            cmd = pending.pop(0)
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, text=True)))
        cmd, proc = running.pop(0)
        stderr = proc.communicate()[1]
        if proc.returncode != 0 and failed is None:
            failed = f"{' '.join(cmd)} failed:\n{stderr[-2000:]}"
            pending.clear()
    if failed is not None:
        raise RuntimeError(failed)


def cpu_kernels() -> ctypes.CDLL | None:
    """The compiled CPU kernel library, or None when unavailable (the reason is logged once)."""
    global _library
    with _lock:
        if _library is _NOT_LOADED:
            _library = _load()
        return _library


def _load() -> ctypes.CDLL | None:
    if not envs.get("PAGEDLLM_CPU_KERNELS"):
        logger.info("CPU kernels disabled (PAGEDLLM_CPU_KERNELS is off)")
        return None
    try:
        return build_cpu_kernels()
    except (OSError, RuntimeError) as e:
        logger.warning("CPU kernels unavailable (%s): using the portable torch paths", e)
        return None


def build_cpu_kernels(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile (once per source, flags and CPU) and load the kernel library.

    `extra_flags` are appended to the compiler flags (the tests build a variant without AVX2,
    `("-mno-avx2", "-mno-fma")`, to check the portable code path).

    Raises:
        RuntimeError: no C++ compiler, a failed build, or a library of another ABI version.
        OSError: the cache directory cannot be written or the library cannot be loaded.
    """
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    flags = (*_CXXFLAGS, *extra_flags)
    csrc = Path(__file__).parent / "csrc"
    digest = hashlib.sha256()
    for part in (compiler, " ".join(flags), _cpu_flags_line(), abi.c_header()):
        digest.update(part.encode())
    for path in _key_files(csrc):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    target = _cache_dir() / digest.hexdigest()[:16] / "libpagedllm_cpu.so"
    import torch  # noqa: F401  (load torch's OpenMP runtime first, so the library shares it)
    if not target.exists():
        logger.info("compiling the CPU kernels (first run on this machine or after an "
                    "update; once, about half a minute on 2 idle cores) into %s", target)
        _build(compiler, flags, target)
    lib = ctypes.CDLL(str(target))
    version = lib.pagedllm_abi_version()
    if version != abi.ABI_VERSION:
        raise RuntimeError(f"kernel ABI version {version}, expected {abi.ABI_VERSION}")
    abi.declare(lib)
    return lib
