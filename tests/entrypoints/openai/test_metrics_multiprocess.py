"""/metrics across API-server processes (prometheus_client's multiprocess mode, metrics.py):
counters and histograms add up over the processes, the engine gauges show the value written
last for each replica (not the sum), and the pool's metrics folder is private and removed.

Two "API servers" here are a process and its fork, each with its own PrometheusStatLogger state
in the shared folder (the variable must be set before prometheus_client is imported, hence the
subprocess).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.entrypoints.openai.metrics import setup_multiprocess_metrics

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"   # prometheus_client's switch

_SCRIPT = r"""
import os, sys, time
from pagedllm.core.kv_cache_manager import PrefixCacheStats
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.engine.iteration_stats import FinishedRequestStats, IterationStats
from pagedllm.entrypoints.openai.metrics import PrometheusStatLogger

def stats(running, waiting):
    return SchedulerStats(running, waiting, running / 10, 10, 10 - running, 0,
                          PrefixCacheStats(), 0, SpecDecodingStats())

def finished(reason, n):
    return IterationStats(num_prompt_tokens=7 * n, num_generation_tokens=5 * n,
                          time_to_first_tokens_s=[0.01] * n, finished_requests=[
                              FinishedRequestStats(reason, 7, 5, 0.2) for _ in range(n)])

metrics = PrometheusStatLogger("m")
replica1 = metrics.for_engine(1)
child = os.fork()
if child == 0:      # API server B: two requests on replica 0, one on replica 1
    metrics.record(stats(running=4, waiting=2), finished("length", 2))
    replica1.record(stats(running=5, waiting=0), finished("length", 1))
    os._exit(0)
assert os.waitpid(child, 0)[1] == 0
time.sleep(0.01)
# API server A, later: the core's newer state of replica 0, and its own request
metrics.record(stats(running=1, waiting=0), finished("stop", 1))
sys.stdout.buffer.write(metrics.render())
"""


def _value(text: str, sample: str) -> list[float]:
    pattern = re.escape(sample).replace(r"\*", "[^}]*")
    return [float(v) for v in re.findall(pattern + r" (\S+)", text)]


def test_api_servers_metrics_add_up_and_gauges_do_not(tmp_path: Path) -> None:
    folder = tmp_path / "prom"
    folder.mkdir()
    env = {**os.environ, MULTIPROC_DIR_ENV: str(folder),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]),
                                          os.environ.get("PYTHONPATH", "")])}
    text = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, check=True, timeout=120,
                          capture_output=True).stdout.decode()
    success = 'pagedllm:request_success_total{finished_reason="%s",model_name="m"}'
    assert _value(text, success % "length") == [3.0]
    assert _value(text, success % "stop") == [1.0]
    assert _value(text, 'pagedllm:generation_tokens_total{model_name="m"}') == [20.0]
    assert _value(text, 'pagedllm:time_to_first_token_seconds_count{model_name="m"}') == [4.0]
    # Gauges: the last value written per replica, one series each, no per-process series.
    running = 'pagedllm:num_requests_running{engine="%s",model_name="m"}'
    assert _value(text, running % "0") == [1.0]
    assert _value(text, running % "1") == [5.0]
    assert _value(text, 'pagedllm:num_requests_waiting{engine="0",model_name="m"}') == [0.0]
    assert "pid=" not in text


def test_pool_metrics_folder_is_private_and_removed(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(MULTIPROC_DIR_ENV, raising=False)
    monkeypatch.delenv(MULTIPROC_DIR_ENV.lower(), raising=False)
    clean_up = setup_multiprocess_metrics()
    folder = Path(os.environ[MULTIPROC_DIR_ENV])
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700
    clean_up()
    assert not folder.exists() and MULTIPROC_DIR_ENV not in os.environ
    # A folder the user chose is used as it is and kept.
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    setup_multiprocess_metrics()()
    assert os.environ[MULTIPROC_DIR_ENV] == str(tmp_path) and tmp_path.is_dir()


@pytest.mark.parametrize("name", [MULTIPROC_DIR_ENV, MULTIPROC_DIR_ENV.lower()])
def test_metrics_folder_variable_names(monkeypatch, tmp_path: Path, name: str) -> None:
    """Both spellings prometheus_client honours count as set by the user."""
    monkeypatch.delenv(MULTIPROC_DIR_ENV, raising=False)
    monkeypatch.delenv(MULTIPROC_DIR_ENV.lower(), raising=False)
    monkeypatch.setenv(name, str(tmp_path))
    setup_multiprocess_metrics()()
    assert os.environ[name] == str(tmp_path)
