"""Run `pagedllm ...` (e.g. `serve`) with every thread of every process under cProfile, counting
CPU time (`time.thread_time`), not wall time: where a process spends its CPU, not where it waits.

    PAGEDLLM_PROFILE_DIR=/tmp/prof python scripts/profile_serve.py serve --multiprocess-mode ...

Each thread's profile is written at interpreter exit (stop the server with SIGTERM) to
`$PAGEDLLM_PROFILE_DIR/<pid>-<thread name>.prof`; read them with `pstats` (or
`python scripts/profile_serve.py --report DIR`, which prints the top functions of each file by
own and cumulative time). SIGUSR1 to a process clears its profiles so far (send it after
start-up, before the load, so the profiles cover only the load). The engine-core process (started with multiprocessing's `spawn`)
imports this file again as its main module, so its threads are profiled too. A tool for
measuring, not part of the engine: the hook is `threading.setprofile`, which starts a profiler
in each new thread on its first profiled call.
"""

from __future__ import annotations

import atexit
import cProfile
import os
import pstats
import signal
import sys
import threading
import time

_DIR = os.environ.get("PAGEDLLM_PROFILE_DIR")
_profilers: list[tuple[str, cProfile.Profile]] = []
_lock = threading.Lock()


def _start_here(*_args) -> None:
    """The first profile event of a new thread: give it its own CPU-time profiler."""
    prof = cProfile.Profile(time.thread_time)
    with _lock:
        _profilers.append((threading.current_thread().name, prof))
    prof.enable()   # replaces this thread's profile hook (this function)


def _dump() -> None:
    for name, prof in list(_profilers):
        prof.disable()   # (only affects the calling thread; the others' data is kept as is)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        prof.dump_stats(os.path.join(_DIR, f"{os.getpid()}-{safe}.prof"))


def _clear(*_args) -> None:
    for _, prof in list(_profilers):
        prof.clear()


def _install() -> None:
    os.makedirs(_DIR, exist_ok=True)
    threading.setprofile(_start_here)
    _start_here()
    atexit.register(_dump)
    signal.signal(signal.SIGUSR1, _clear)


def report(folder: str, top: int = 25) -> None:
    """Print, per profile file in `folder`, its total CPU seconds and the top functions."""
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".prof"):
            continue
        stats = pstats.Stats(os.path.join(folder, name))
        print(f"==== {name}: {stats.total_tt:.2f} CPU s")
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)


if _DIR and __name__ in ("__main__", "__mp_main__"):
    _install()

if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:
        report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 25)
        sys.exit(0)
    from pagedllm.entrypoints.cli import main

    sys.exit(main(sys.argv[1:]))
