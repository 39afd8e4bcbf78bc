"""Tensor parallelism end to end: tp=2 over two worker processes (gloo on CPU) must give the same
greedy tokens as the single-process engine on the tiny fp32 checkpoints, and a dead worker must
fail the engine loudly and leave no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import create_engine_config
from pagedllm.executor.abstract import WorkerDiedError
from tests.distributed.common import ENGINE_ARGS, PROMPTS, generate, run


# "llama": 4 heads / 2 KV heads, one KV head per rank; "llama_mqa_tied_llama3": the single KV
# head is replicated on both ranks and the LM head shares the vocab-parallel embedding; "qwen2":
# q/k/v biases sharded with their heads.
@pytest.mark.parametrize("variant", ["llama", "llama_mqa_tied_llama3", "qwen2"])
def test_tp2_multiproc_matches_tp1(tiny_checkpoints, variant):
    path = tiny_checkpoints[variant]
    params = [SamplingParams(max_tokens=10, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=1.0, seed=7)]
    expected = run(path, params)
    got = run(path, params, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert got[0] == expected[0]
    # Every rank samples from the same all-gathered logits with the same seed.
    assert got[1] == expected[1]


def test_killed_worker_fails_loudly_without_orphans(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), **ENGINE_ARGS, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    executor = llm.llm_engine.engine_core.executor
    pids = executor.worker_pids
    try:
        assert len(generate(llm, SamplingParams(max_tokens=2, temperature=0.0))) == 3
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 30     # a bound against a hang, not a speed check
    finally:
        llm.llm_engine.engine_core.shutdown()
    for proc in executor.procs:
        assert not proc.is_alive()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(WorkerDiedError, match="shut down"):
        executor.execute_model(None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "needs 'mp' or 'ray'"),
    (dict(distributed_executor_backend="dask"), "must be one of"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(pipeline_parallel_size=3), "exceeds the model's 2 layers"),
    (dict(pipeline_parallel_size=2,
          speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config is not supported with pipeline_parallel_size > 1"),
    (dict(tensor_parallel_size=2, nnodes=2, master_port=29500,
          distributed_executor_backend="ray"), "nnodes > 1 is for distributed_executor_backend"),
    (dict(tensor_parallel_size=2, nnodes=3, master_port=29500), "not divisible by nnodes 3"),
])
def test_parallel_config_errors_name_the_field(tiny_checkpoints, kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_engine_config(str(tiny_checkpoints["llama"]), **kwargs)


def test_default_backend_follows_world_size(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    assert create_engine_config(path).parallel_config.distributed_executor_backend == "uni"
    config = create_engine_config(path, tensor_parallel_size=2)
    assert config.parallel_config.distributed_executor_backend == "mp"
