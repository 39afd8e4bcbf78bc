"""ModelRunner._prepare_inputs against a naive per-token Python reference on random schedules."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def runner(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=512)
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("seed", range(4))
def test_prepare_inputs_matches_reference(runner, seed):
    rng = np.random.default_rng(seed)
    bs = runner.block_size
    so = SchedulerOutput.make_empty()
    expected = {}
    next_block = 1
    for i in range(int(rng.integers(1, 6))):
        n_tokens = int(rng.integers(1, 60))
        tokens = rng.integers(0, 100, n_tokens).tolist()
        computed = int(rng.integers(0, n_tokens))
        scheduled = int(rng.integers(1, n_tokens - computed + 1))
        nb = -(-(computed + scheduled) // bs)
        blocks = list(range(next_block, next_block + nb))[::-1]
        next_block += nb
        req_id = f"r{seed}_{i}"
        so.scheduled_new_reqs.append(NewRequestData(req_id, tokens[:5], tokens[5:],
                                                    SamplingParams(), blocks, computed))
        so.num_scheduled_tokens[req_id] = scheduled
        expected[req_id] = (tokens, computed, scheduled, blocks)
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    runner._update_states(so)
    batch, common = runner._prepare_inputs(so)
    ids, pos, slots, logits_idx, start = [], [], [], [], 0
    for req_id in batch.req_ids:
        tokens, computed, scheduled, blocks = expected[req_id]
        for p in range(computed, computed + scheduled):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
        start += scheduled
        if computed + scheduled >= len(tokens):
            logits_idx.append(start - 1)
    assert batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == pos
    assert common.slot_mapping.tolist() == slots
    assert batch.logits_indices.tolist() == logits_idx
    assert common.seq_lens_cpu.tolist() == [expected[r][1] + expected[r][2] for r in batch.req_ids]
    for req_id in batch.req_ids:
        runner.states.remove_request(req_id)
