"""The co-tenant benchmark's pieces (benchmarks/co_tenants.py): the start barrier across
parties and its abort, and the flags a copy is run without. The whole command runs in
test_bench_smoke.py."""

from __future__ import annotations

import threading

import pytest

from pagedllm.benchmarks.co_tenants import StartBarrier, run_co_tenants, strip_co_tenant_flags


def test_the_barrier_waits_for_every_party(tmp_path):
    passed: list[int] = []

    def party(i: int) -> None:
        StartBarrier.from_arg(f"{tmp_path}:{i}:3").wait("pagedllm")
        passed.append(i)

    threads = [threading.Thread(target=party, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    threads[0].join(0.2)
    assert passed == []                      # the third party has not arrived
    party(2)
    for t in threads:
        t.join(5)
    assert sorted(passed) == [0, 1, 2]


def test_an_abort_or_a_timeout_ends_the_wait(tmp_path):
    (tmp_path / "abort").touch()
    with pytest.raises(RuntimeError, match="another copy failed"):
        StartBarrier(tmp_path, 0, 2).wait("pagedllm")
    (tmp_path / "abort").unlink()
    with pytest.raises(RuntimeError, match="did not arrive"):
        StartBarrier(tmp_path, 0, 2, timeout_s=0.05).wait("llamacpp")


def test_copies_run_without_the_co_tenant_flags():
    argv = ["--preset", "llama-tiny", "--co-tenants", "2", "--busy-co-tenants=1",
            "--output-json", "x.json", "--num-prompts", "2"]
    assert strip_co_tenant_flags(argv) == ["--preset", "llama-tiny", "--num-prompts", "2"]
    with pytest.raises(ValueError, match="--co-tenants must be >= 1"):
        run_co_tenants([], 0, 0)
