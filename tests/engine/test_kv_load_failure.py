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
