"""The thread governor (platforms/cpu_contention.py): scripted CPU readings in, thread counts
out; and its /proc readers on a fake tree and on this machine."""

from __future__ import annotations

import os

import pytest

from pagedllm.platforms.cpu_contention import (CpuSample, ThreadGovernor, read_idle_ticks,
                                               read_runqueue_wait_ns)

TICK = os.sysconf("SC_CLK_TCK")


def _governor(max_threads: int, readings: list[tuple[float, float, float]]):
    """A governor fed (time s, cumulative run-queue wait s, cumulative idle CPU-s) readings;
    returns it and the list of counts it applied."""
    applied: list[int] = []
    samples = iter(CpuSample(t, int(w * 1e9), int(i * TICK)) for t, w, i in readings)
    gov = ThreadGovernor(max_threads, {0, 1}, applied.append, interval_s=0.0,
                         sample=lambda: next(samples))
    return gov, applied


def test_waiting_threads_shrink_and_idle_cores_grow_back_after_the_backoff():
    # 2 threads waiting 60% of the time -> 1; then the cores come back idle: growth waits for
    # the 2 s backoff, then returns to the planned 2 (never above).
    gov, applied = _governor(2, [(0, 0, 0), (1, 1.2, 0), (2, 1.2, 1), (3.5, 1.2, 2.5),
                                 (4.5, 1.2, 3.5), (5.5, 1.2, 4.5)])
    results = [gov.observe() for _ in range(6)]
    assert results == [None, 1, None, 2, None, None]
    assert applied == [1, 2] and gov.num_threads == 2


def test_no_change_when_alone_or_after_a_gap_and_never_below_one():
    gov, applied = _governor(2, [(0, 0, 0), (1, 0.02, 0.1), (2, 0.04, 0.2),
                                 (10, 9.0, 0), (11, 10.0, 0), (12, 11.0, 0), (13, 12.0, 0)])
    assert [gov.observe() for _ in range(4)] == [None, None, None, None]   # gap: new baseline
    assert gov.observe() == 1                                            # 50% waiting
    assert gov.observe() is None and gov.observe() is None               # already one
    assert applied == [1]
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0, {0}, applied.append)


def test_the_backoff_doubles_when_processes_keep_crossing():
    gov, _ = _governor(2, [(0, 0, 0), (1, 1, 0), (3.1, 1, 2.1), (4, 2, 2.1), (6.5, 2, 4.6),
                           (8.5, 2, 6.6)])
    assert [gov.observe() for _ in range(6)] == [None, 1, 2, 1, None, 2]   # 2 s, then 4 s


def test_proc_readers(tmp_path):
    for tid, wait in (("10", 5), ("11", 7)):
        (tmp_path / "self" / "task" / tid).mkdir(parents=True)
        (tmp_path / "self" / "task" / tid / "schedstat").write_text(f"100 {wait} 3\n")
    (tmp_path / "stat").write_text("cpu  1 2 3 4 5 6\ncpu0 1 0 1 10 1 0\ncpu1 1 0 1 20 2 0\n"
                                   "intr 5\n")
    assert read_runqueue_wait_ns(tmp_path) == 12
    assert read_idle_ticks({1}, tmp_path) == 22 and read_idle_ticks({0, 1}, tmp_path) == 33
    assert read_runqueue_wait_ns(tmp_path / "missing") == 0
    assert read_idle_ticks({0}, tmp_path / "missing") == 0
    assert read_runqueue_wait_ns() >= 0 and read_idle_ticks(set(os.sched_getaffinity(0))) > 0


def test_a_pause_before_a_step_starts_the_interval_again():
    # Shrunk at t=1; then the engine waits 3 s (its cores idle meanwhile) and steps again. The
    # step's start takes a new baseline, so the pause does not read as cores given back.
    readings = [(0, 0, 0), (1, 0.6, 0), (4, 0.6, 3), (4.3, 0.6, 3)]
    gov, applied = _governor(2, readings)
    gov.observe(), gov.observe()
    gov.step_started()
    assert gov.observe() is None and applied == [1]
    # Without the new baseline the window 1 -> 4.3 s looks idle and the thread comes back.
    gov, applied = _governor(2, [r for r in readings if r[0] != 4])
    assert [gov.observe() for _ in range(3)] == [None, 1, 2]


def test_a_long_step_is_no_gap(monkeypatch):
    """A multi-step round that takes 40 s on a loaded machine (threads waiting 60% of it) is
    stepping, not an idle gap: the governor shrinks after it. An idle pause before a step
    still starts a new interval (the reading is taken again when the step starts)."""
    import pagedllm.platforms.cpu_contention as cc

    clock = [0.0]
    wait = [0.0]
    monkeypatch.setattr(cc.time, "monotonic", lambda: clock[0])
    applied: list[int] = []
    gov = ThreadGovernor(2, {0, 1}, applied.append, interval_s=0.25,
                         sample=lambda: CpuSample(clock[0], int(wait[0] * 1e9), 0))
    gov.step_started()
    assert gov.observe() is None                       # the first reading
    clock[0] = 0.1
    gov.step_started()
    clock[0], wait[0] = 40.1, 48.0                     # 2 threads x 40 s, 60% waiting
    assert gov.observe() == 1 and applied == [1]
    # Idle for 100 s, then a 1 s step with waiting: decided on the step's readings alone.
    gov2 = ThreadGovernor(2, {0, 1}, applied.append, interval_s=0.25,
                          sample=lambda: CpuSample(clock[0], int(wait[0] * 1e9), 0))
    gov2.step_started()
    assert gov2.observe() is None
    clock[0] += 100.0
    gov2.step_started()
    clock[0] += 1.0
    wait[0] += 1.5                                     # 75% of 2 threads x 1 s
    assert gov2.observe() == 1
