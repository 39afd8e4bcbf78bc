"""Fewer kernel threads while other processes take the process's cores, all of them again when
the cores come back (`ThreadGovernor`).

The kernels' threads meet at barriers about ten times a layer. When another process runs on
the same cores (a second engine, a data-parallel replica, the API server's tokenizer, a
co-tenant's job), some thread of ours is always waiting for a core, and every barrier waits for
it: two engines on two cores each get a sixth of their speed instead of a half. One thread
fewer per process removes the waits (on llama-134m bf16 at batch 1, one thread does 83% of
two threads' tokens/s, and two one-thread processes together 144% of one two-thread process;
docs/benchmarks.md "Shared machines").

The governor reads, over each interval of stepping, how long this process's threads waited
in the run queue for a CPU (`/proc/self/task/*/schedstat`, its second field, ns) and how idle
the CPUs it may use were (`/proc/stat`, idle + iowait ticks): threads waiting more than
`shrink_wait_fraction` of the time -> one thread fewer; more than `grow_idle_cpus` CPUs idle and
almost no waiting -> one more, never above the planned count. After a shrink, growth waits
`backoff_s`, doubling with each further shrink (processes that keep crossing are competing)
and reset after a quiet minute. The thread count changes only how work is shared:
the kernels' sums do not depend on it, so outputs are unchanged.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_PROC = Path("/proc")
_CLK_TCK = os.sysconf("SC_CLK_TCK")      # /proc/stat's ticks per second


@dataclass(frozen=True)
class CpuSample:
    """One reading: monotonic seconds, the process's run-queue wait (ns, summed over its
    threads) and the idle ticks of the CPUs it may use (1/CLK_TCK s)."""

    time_s: float
    runqueue_wait_ns: int
    idle_ticks: int


def read_runqueue_wait_ns(proc: Path = _PROC) -> int:
    """Nanoseconds this process's threads have waited in run queues for a CPU, summed (0
    where schedstat cannot be read)."""
    total = 0
    try:
        tasks = os.listdir(proc / "self" / "task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            fields = (proc / "self" / "task" / tid / "schedstat").read_text().split()
            total += int(fields[1])
        except (OSError, IndexError, ValueError):     # a thread that ended meanwhile
            continue
    return total


def read_idle_ticks(cpus: frozenset[int] | set[int], proc: Path = _PROC) -> int:
    """Idle + iowait ticks of `cpus` since boot, from /proc/stat's per-CPU lines (0 where it
    cannot be read)."""
    total = 0
    try:
        lines = (proc / "stat").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            total += int(fields[3]) + int(fields[4])
    return total


class ThreadGovernor:
    """Fits the intra-op thread count to the CPUs this process gets (see the module docstring).

    Args:
        max_threads: the planned count (never exceeded; the starting count).
        cpus: the logical CPUs the process may run on (whose idle time counts).
        set_threads: applies a count (torch.set_num_threads; called from the thread that runs
            the kernels, whose OpenMP settings it changes).
        interval_s: seconds of stepping per decision.
        sample: reads a CpuSample (tests pass their own).

    Raises:
        ValueError: max_threads < 1.
    """

    shrink_wait_fraction = 0.2
    grow_idle_cpus = 0.75
    grow_max_wait_fraction = 0.05
    backoff_s = 2.0
    max_backoff_s = 32.0
    quiet_reset_s = 60.0
    max_gap_s = 5.0

    def __init__(self, max_threads: int, cpus: frozenset[int] | set[int],
                 set_threads: Callable[[int], None], interval_s: float = 0.25,
                 sample: Callable[[], CpuSample] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"ThreadGovernor: max_threads must be >= 1, got {max_threads}")
        self.max_threads = self.num_threads = max_threads
        self.interval_s = interval_s
        self._cpus = frozenset(cpus)
        self._set_threads = set_threads
        self._sample = sample or self._read
        self._last: CpuSample | None = None
        # When the current step started (`step_started`; None before the first).
        self._step_start: float | None = None
        self._backoff = self.backoff_s
        self._no_growth_until = 0.0
        self._last_change = 0.0

    def _read(self) -> CpuSample:
        return CpuSample(time.monotonic(), read_runqueue_wait_ns(), read_idle_ticks(self._cpus))

    def step_started(self) -> None:
        """Called before each step: after a pause (no step for longer than an interval; the
        engine had no work, or waited), the interval starts again here, so that its readings
        cover stepping only (idle cores while this process itself waited say nothing about the
        other processes)."""
        now = time.monotonic()
        if self._last is not None and now - self._last.time_s > self.interval_s:
            self._last = self._sample()
            now = self._last.time_s
        self._step_start = now

    def observe(self) -> int | None:
        """Called after each step: at most once an interval, reads the CPUs and changes the
        thread count if it should; returns the new count, or None when unchanged. A gap of more
        than `max_gap_s` before the step (the engine had no work) starts a new interval without
        a decision; a long step itself (a multi-step round at seconds per step on a loaded
        machine) is no gap: its readings are the stepping this governor is for."""
        now = time.monotonic()
        if self._last is not None and now - self._last.time_s < self.interval_s:
            return None
        sample = self._sample()
        prev, self._last = self._last, sample
        if prev is None:
            return None
        elapsed = sample.time_s - prev.time_s
        # The time before the step began (all of the interval when steps are not reported).
        gap = elapsed if self._step_start is None else self._step_start - prev.time_s
        if elapsed <= 0 or gap > self.max_gap_s:
            return None
        wait = (sample.runqueue_wait_ns - prev.runqueue_wait_ns) / 1e9 / elapsed / self.num_threads
        idle = (sample.idle_ticks - prev.idle_ticks) / _CLK_TCK / elapsed
        if sample.time_s - self._last_change > self.quiet_reset_s:
            self._backoff = self.backoff_s
        new = self.num_threads
        if wait > self.shrink_wait_fraction and new > 1:
            new -= 1
            self._no_growth_until = sample.time_s + self._backoff
            self._backoff = min(self._backoff * 2, self.max_backoff_s)
        elif (idle > self.grow_idle_cpus and wait < self.grow_max_wait_fraction
              and new < self.max_threads and sample.time_s >= self._no_growth_until):
            new += 1
        if new == self.num_threads:
            return None
        logger.info("CPU: %d -> %d threads (threads waited %.0f%% of the time for a CPU, %.1f "
                    "CPUs idle; the machine's other processes %s)", self.num_threads, new,
                    100 * wait, idle, "need cores" if new < self.num_threads else "gave cores back")
        self._set_threads(new)
        self.num_threads = new
        self._last_change = sample.time_s
        return new
