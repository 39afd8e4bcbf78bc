"""The OpenMP wait policy pagedllm sets before torch loads (pagedllm/omp_wait.py), in fresh
interpreters: the default, a user's own setting kept, and torch imported first."""

from __future__ import annotations

import os
import subprocess
import sys

from pagedllm.omp_wait import DEFAULT_SPIN_COUNT

_SHOW = ("import os, pagedllm.omp_wait as w; "
         "print(os.environ.get('GOMP_SPINCOUNT'), '|', w.wait_policy_description())")


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_import_pagedllm_sets_the_spin_count_for_this_process_and_its_children():
    out = _run("import pagedllm; " + _SHOW)
    assert out.startswith(f"{DEFAULT_SPIN_COUNT} |") and "pagedllm's default" in out
    child = _run("import pagedllm, subprocess, sys; subprocess.run([sys.executable, '-c', "
                 "'import os; print(os.environ[\"GOMP_SPINCOUNT\"])'])")
    assert child == str(DEFAULT_SPIN_COUNT)
    inherited = _run("import pagedllm; " + _SHOW, GOMP_SPINCOUNT=str(DEFAULT_SPIN_COUNT))
    assert "pagedllm's default, inherited" in inherited


def test_a_users_setting_is_kept():
    assert _run("import pagedllm; " + _SHOW, GOMP_SPINCOUNT="5") == (
        "5 | set by the user: GOMP_SPINCOUNT=5")
    out = _run("import pagedllm; " + _SHOW, OMP_WAIT_POLICY="passive")
    assert out == "None | set by the user: OMP_WAIT_POLICY=passive"


def test_torch_imported_first_is_reported_not_changed():
    out = _run("import torch, pagedllm; " + _SHOW)
    assert out.startswith("None |") and "torch was imported before pagedllm" in out
