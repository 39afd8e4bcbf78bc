"""Stale P2pShmConnector files: a producer killed with SIGKILL leaves its transfer files in
shm_dir; the next producer to start on that folder removes them (core/kv_connector/shm_owner.py),
and never a live producer's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pagedllm import LLM
from pagedllm.core.kv_connector.p2p_transport import transfer_file, transfer_key
from pagedllm.core.kv_connector.shm_owner import ShmOwnership, lock_file
from tests.engine.test_pd_disagg import ENGINE, free_port, pd_config

_PRODUCER = textwrap.dedent("""
    import json, sys, time
    from pagedllm import LLM, SamplingParams
    model, port, shm = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    llm = LLM(model, dtype="float32", block_size=16, max_num_seqs=4,
              num_gpu_blocks_override=64,
              kv_transfer_config={"kv_connector": "P2pShmConnector", "kv_role": "kv_producer",
                                  "kv_port": port,
                                  "kv_connector_extra_config": {"shm_dir": shm}})
    params = SamplingParams(temperature=0.0, max_tokens=1,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    out = llm.generate([[5, 6, 7, 8] * 5], params, use_tqdm=False)[0]
    print(json.dumps(out.kv_transfer_params), flush=True)
    time.sleep(120)
""")


def test_sigkilled_producer_files_are_removed_by_the_next_producer(tiny_llama, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, str(tiny_llama), str(port),
                             str(shm)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        params = json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    engine_id = params["remote_engine_id"]
    stale = transfer_file(shm, engine_id, transfer_key(params["remote_request_id"]), 0)
    assert stale.exists() and lock_file(shm, engine_id).exists()   # left behind by the kill

    # A producer with another engine id: the dead one's files and lock go, its own stay.
    other_port = free_port()
    other = LLM(str(tiny_llama), **ENGINE, kv_transfer_config=pd_config("kv_producer",
                                                                        other_port, shm))
    try:
        assert not stale.exists() and not lock_file(shm, engine_id).exists()
        assert [p.name for p in shm.iterdir()] == [f"pagedllm-kv-pagedllm{other_port}.lock"]
    finally:
        other.llm_engine.engine_core.shutdown()
    assert list(shm.iterdir()) == []   # a clean shutdown leaves nothing


def test_live_producers_files_are_kept_and_their_engine_id_refused(tmp_path):
    live = ShmOwnership(tmp_path, "live")
    live_file = transfer_file(tmp_path, "live", "a" * 32, 0)
    live_file.write_bytes(b"x")
    orphan = transfer_file(tmp_path, "gone", "b" * 32, 1)    # no lock file at all
    orphan.write_bytes(b"x")
    half = tmp_path / (transfer_file(tmp_path, "gone", "c" * 32, 0).name + ".tmp123")
    half.write_bytes(b"x")
    try:
        second = ShmOwnership(tmp_path, "second")
        assert second.num_swept == 2 and live_file.exists()
        assert not orphan.exists() and not half.exists()
        with pytest.raises(ValueError, match="live producer already uses engine_id 'live'"):
            ShmOwnership(tmp_path, "live")
        second.release()
    finally:
        live.release()
    # Restarted with the same engine id: its previous run's files are stale.
    again = ShmOwnership(tmp_path, "live")
    assert again.num_swept == 1 and not live_file.exists()
    again.release()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="is not a folder"):
        ShmOwnership(tmp_path / "missing", "x")


def test_files_of_a_consumer_that_died_holding_them_go_while_the_producer_runs(tmp_path):
    """A pull hands the files over to the consumer (renamed into its owner id, under its own
    lock). A consumer killed before loading them leaves its lock free: the running
    producer's next periodic sweep deletes them, never its own files or a live consumer's."""
    producer = ShmOwnership(tmp_path, "prod", sweep_interval=0.0)
    consumer = ShmOwnership(tmp_path, "prod-decode1.aa")
    own = transfer_file(tmp_path, "prod", "a" * 32, 0)
    live = transfer_file(tmp_path, "prod-decode1.aa", "b" * 32, 0)
    dead = transfer_file(tmp_path, "prod-decode2.bb", "c" * 32, 0)
    for path in (own, live, dead):
        path.write_bytes(b"x")
    lock_file(tmp_path, "prod-decode2.bb").write_text("2\n")   # (its holder died)
    try:
        assert producer.maybe_sweep() == 1
        assert own.exists() and live.exists() and not dead.exists()
        assert not lock_file(tmp_path, "prod-decode2.bb").exists()
        slow = ShmOwnership(tmp_path, "other", sweep_interval=3600.0)
        dead.write_bytes(b"x")   # (no lock at all: swept too, at the next interval)
        assert slow.maybe_sweep() == 0 and producer.maybe_sweep() == 1
        slow.release()
    finally:
        consumer.release()
        producer.release()
