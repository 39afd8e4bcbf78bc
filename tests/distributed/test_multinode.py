"""Multi-node `mp` layout, both "nodes" on this machine: node 0 is the engine (rank 0), node 1 a
`pagedllm worker --node-rank 1` process (rank 1) reached through the MASTER_ADDR/PORT rendezvous.
Greedy tokens equal the single-process engine's; when node 1 goes away the engine fails loudly."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import WorkerDiedError
from pagedllm.executor.multiproc import get_open_port
from tests.distributed.common import ENGINE_ARGS, PROMPTS


@pytest.mark.slow
def test_two_nodes_tp2_matches_tp1_and_fails_loudly_when_a_node_dies(tiny_checkpoints, tmp_path):
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref = LLM(path, **ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]

    port = get_open_port()
    cli_args = ["--dtype", "float32",
                "--kv-cache-memory", str(ENGINE_ARGS["kv_cache_memory_bytes"]),
                "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
                "--no-enable-prefix-caching", "-tp", "2", "--nnodes", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "worker",
                              "--model", path, *cli_args, "--node-rank", "1"],
                             stdout=subprocess.DEVNULL, stderr=log)
    try:
        llm = LLM(path, **ENGINE_ARGS, tensor_parallel_size=2, nnodes=2,
                  master_addr="127.0.0.1", master_port=port)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            assert got == expected
            node1.terminate()
            assert node1.wait(timeout=20) == 143
            start = time.monotonic()
            with pytest.raises(WorkerDiedError, match="rank 0"):
                llm.generate(PROMPTS, params, use_tqdm=False)
            assert time.monotonic() - start < 10
        finally:
            llm.llm_engine.engine_core.shutdown()
        assert not any(p.is_alive() for p in llm.llm_engine.engine_core.executor.procs)
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.wait()
        log.close()
