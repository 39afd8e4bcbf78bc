"""How long the OpenMP threads of the CPU kernels spin before they sleep.

The native kernels and torch's CPU ops run on one OpenMP runtime (GNU libgomp: torch's wheels
bundle it and the kernel library resolves to the copy torch loaded). Its threads meet at barriers
about ten times a layer and wait for the next parallel region between them. By default a
waiting thread spins 300,000 times (GOMP_SPINCOUNT; a few milliseconds, a whole scheduler
time slice) before it sleeps on a futex. Alone on its cores that costs nothing, but when another
process (a second engine, a tensor-parallel rank or data-parallel replica on the same cores, the
API server, a co-tenant) needs a core, the spinning threads hold it while the thread they wait
for is descheduled: two engines on two cores then do less than half the work of one.

`apply_default_wait_policy()` (called by `import pagedllm`, before torch loads: libgomp reads
its settings once, when it is loaded) sets GOMP_SPINCOUNT to `DEFAULT_SPIN_COUNT` (and Intel's
runtime's KMP_BLOCKTIME to 1 ms, for torch builds on libiomp): a third of libgomp's default,
the shortest budget measured that keeps the alone figures (shorter ones lose on steps whose
Python work between parallel regions outlasts the spin, 3-4% at 32 x 128 for 30,000, much
more at batch 1 below 1,000). Shorter waits alone cannot rescue two processes on the same
cores (every barrier still waits for a descheduled thread), which is what the thread governor
(platforms/cpu_contention.py) is for. Figures: docs/benchmarks.md "Shared machines". A user's
own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is.
"""

from __future__ import annotations

import os
import sys

# Spins of libgomp's wait loop (a `pause` instruction and a load each) before a futex wait:
# the measured choice, docs/benchmarks.md "Shared machines".
DEFAULT_SPIN_COUNT = 100000

# Set by apply_default_wait_policy: what the runtime was given, for the start-up log.
_applied: str | None = None


def apply_default_wait_policy() -> None:
    """Set GOMP_SPINCOUNT (and KMP_BLOCKTIME) in this process's environment, and so in every
    process it starts, unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT. Call before torch
    is imported; afterwards the runtime has read its settings and this only records that."""
    global _applied
    if _applied is not None:
        return
    user = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
            "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT")}
    if user == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": str(DEFAULT_SPIN_COUNT)}:
        _applied = f"GOMP_SPINCOUNT={DEFAULT_SPIN_COUNT} (pagedllm's default, inherited)"
        return
    if any(user.values()):
        _applied = "set by the user: " + ", ".join(f"{n}={v}" for n, v in user.items() if v)
        return
    if "torch" in sys.modules:
        _applied = ("the runtime's default (torch was imported before pagedllm: set "
                    f"GOMP_SPINCOUNT={DEFAULT_SPIN_COUNT} to wait as pagedllm does)")
        return
    os.environ["GOMP_SPINCOUNT"] = str(DEFAULT_SPIN_COUNT)
    os.environ.setdefault("KMP_BLOCKTIME", "1")
    _applied = f"GOMP_SPINCOUNT={DEFAULT_SPIN_COUNT} (pagedllm's default)"


def wait_policy_description() -> str:
    """One line on how the OpenMP threads wait, for the start-up log."""
    return _applied or "the runtime's default"
