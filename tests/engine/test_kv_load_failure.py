"""KV load failure recovery (vLLM's `kv_load_failure_policy="recompute"`): a disk-tier file
that vanishes or is rewritten after the scheduler matched it, before the worker reads it (the
race is forced by deleting and corrupting files at the start of the worker's read). The
worker reports the failed blocks (`ModelRunnerOutput.invalid_block_ids`), the scheduler
discards the affected requests' tokens of that step and recomputes them, and the tokens equal
an engine's without a tier; the other request of the batch keeps its loaded prefix, and the
engine goes on serving."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM
from pagedllm.core.kv_cache_utils import hash_block_tokens
from pagedllm.core.kv_connector.disk_tier import block_file
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.executor.abstract import merge_invalid_block_ids
from tests.engine.test_kv_offloading import (ENGINE, FIRST, PARAMS, PREFIXES, SECOND,
                                             _first_block_hash)

# 85 tokens: the step that loads a prefix's 4 blocks also computes a full fifth block, over
# the failed blocks' zeros: that block must never be hit either.
RNG = random.Random(1)
PROMPTS = [p + [RNG.randrange(3, 500) for _ in range(16)] for p in SECOND]


@pytest.fixture(scope="module")
def want(tiny_llama):
    """Greedy tokens of PROMPTS on an engine without a tier."""
    llm = LLM(str(tiny_llama), **ENGINE)
    try:
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(PROMPTS, PARAMS[0], use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_files_changed_after_the_match_are_recomputed(tiny_llama, want, tmp_path,
                                                      async_scheduling):
    tier = dict(kv_offloading_size=0.0001, kv_offloading_dir=str(tmp_path / "kv"))
    llm = LLM(str(tiny_llama), **ENGINE, **tier)
    llm.generate(FIRST, PARAMS[0], use_tqdm=False)   # (every prefix's blocks on disk)
    llm.llm_engine.engine_core.shutdown()
    del llm

    # A new engine: its host tier is empty, so the prefixes all load from disk.
    engine = dict(ENGINE, max_num_seqs=3)   # (prefixes 0, 1 and 2 load in one step)
    llm = LLM(str(tiny_llama), **engine, **tier, async_scheduling=async_scheduling)
    connector = llm.llm_engine.engine_core.executor.worker.kv_connector
    read = connector._read_block_files
    # Prefix 0's second block is rewritten with another block's file and prefix 2's third
    # deleted, both after the scheduler matched them; prefix 1 loads in the same step.
    first = _first_block_hash(PREFIXES[0])
    second = hash_block_tokens(first, PREFIXES[0][16:32])
    third = hash_block_tokens(hash_block_tokens(_first_block_hash(PREFIXES[2]),
                                                PREFIXES[2][16:32]), PREFIXES[2][32:48])
    steps = []

    def race(meta):
        if not steps:
            folder = tmp_path / "kv"
            block_file(folder, second, 0).write_bytes(block_file(folder, first, 0).read_bytes())
            block_file(folder, third, 0).unlink()
        steps.append(list(meta.disk_load_hashes))
        return read(meta)

    connector._read_block_files = race
    outs = llm.generate(PROMPTS[:3], PARAMS[0], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want[:3]
    assert len(steps[0]) == 12 and second in steps[0] and third in steps[0]
    # Prefix 1 kept its loaded blocks; 0 and 2 recomputed from their first failed block on
    # (the blocks before it were hit again in the device cache).
    assert [o.num_cached_tokens for o in outs] == [16, 64, 32]

    # The engine goes on, and the recomputed blocks were stored anew: every prefix hits
    # (the first three prompts' fifth blocks too).
    outs = llm.generate(PROMPTS, PARAMS[0], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [80] * 3 + [64] * 9
    llm.llm_engine.engine_core.shutdown()


def test_merge_invalid_block_ids_takes_every_ranks_failures():
    """The executor's merge: the driver's output gets the union of every rank's failed loads;
    a reply of the wrong kind is a clear error."""
    driver = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0},
                               sampled_token_ids=[[7]], invalid_block_ids={3})
    out = merge_invalid_block_ids([set(), {5, 6}, driver, set()], driver=2)
    assert out is driver and out.invalid_block_ids == {3, 5, 6}
    assert out.sampled_token_ids == [[7]]
    clean = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
    assert merge_invalid_block_ids([clean, set()], driver=0).invalid_block_ids == set()
    with pytest.raises(TypeError, match="rank 1 answered NoneType"):
        merge_invalid_block_ids([clean, None], driver=0)
    with pytest.raises(TypeError, match="driver rank 1 answered set"):
        merge_invalid_block_ids([set(), set()], driver=1)


@pytest.mark.parametrize("layout,rank", [
    ("tensor_parallel_size", 1),
    pytest.param("pipeline_parallel_size", 0, marks=pytest.mark.slow)])
def test_file_deleted_on_a_non_driver_rank_is_recomputed(tiny_llama, want, tmp_path, layout,
                                                         rank):
    """tp=2 or pp=2 (mp workers, each rank with its own disk files): prefix 2's third
    block's file vanishes on one rank only, not the driver (tp: rank 1; pp: rank 0, the first
    stage), after the scheduler matched it. That rank's failure reaches the scheduler through
    the executor's merge (only the driver answers the step with its output), the request is
    recomputed, the tokens equal a no-tier engine's and the engine goes on."""
    tier = {"kv_offloading_size": 0.0001, "kv_offloading_dir": str(tmp_path / "kv"),
            layout: 2, "distributed_executor_backend": "mp"}
    llm = LLM(str(tiny_llama), **ENGINE, **tier)
    llm.generate(FIRST[:3], PARAMS[0], use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    del llm

    llm = LLM(str(tiny_llama), **dict(ENGINE, max_num_seqs=3), **tier)
    try:
        # The race: the file goes after the scheduler side matched it and built the step's
        # metadata, before the workers read it.
        connector = llm.llm_engine.engine_core.scheduler.kv_connector
        build = connector.build_connector_meta
        third = hash_block_tokens(hash_block_tokens(_first_block_hash(PREFIXES[2]),
                                                    PREFIXES[2][16:32]), PREFIXES[2][32:48])
        steps = []

        def race(scheduler_output):
            meta = build(scheduler_output)
            if meta.disk_load_hashes and not steps:
                steps.append(list(meta.disk_load_hashes))
                block_file(tmp_path / "kv", third, rank).unlink()
            return meta

        connector.build_connector_meta = race
        outs = llm.generate(PROMPTS[:3], PARAMS[0], use_tqdm=False)
        assert len(steps[0]) == 12 and third in steps[0]
        assert [list(o.outputs[0].token_ids) for o in outs] == want[:3]
        assert [o.num_cached_tokens for o in outs] == [64, 64, 32]
        # The recomputed blocks were stored anew on both ranks: every prefix hits.
        assert block_file(tmp_path / "kv", third, rank).exists()
        outs = llm.generate(PROMPTS[:3], PARAMS[0], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want[:3]
        assert [o.num_cached_tokens for o in outs] == [80] * 3
    finally:
        llm.llm_engine.engine_core.shutdown()
