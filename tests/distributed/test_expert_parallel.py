"""Expert parallelism and EPLB (issue #19, phase 2).

Oracles: the policy's invariants and its imbalance against the identity placement on a skewed
load; the fused layer with redundant experts, before and after a rebalance, against a naive
per-token loop; the engine with EP / EPLB on against the engine with them off (greedy tokens
equal), in one process and over two worker processes.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import EPLBConfig, ParallelConfig
from pagedllm.distributed.eplb.policy import (default_placement, imbalance,
                                              plan_expert_moves, rank_loads, rebalance_experts)
from pagedllm.distributed.parallel_state import (ExpertParallelLayout, get_tp_group,
                                                 set_expert_parallel_layout)
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.worker.eplb_state import EplbState
from tests.distributed.common import PROMPTS, run
from tests.models.test_moe import _build, _naive_moe

# 2 of 8 experts get half the tokens.
SKEWED_LOAD = np.array([[25.0, 25.0] + [50.0 / 6] * 6])


# ---------------------------------------------------------------------------------- the policy

@pytest.mark.parametrize("seed, num_ranks, redundant", [(0, 2, 2), (1, 4, 4), (2, 3, 1),
                                                        (3, 1, 0), (4, 2, 0)])
def test_placement_invariants(seed, num_ranks, redundant):
    rng = np.random.default_rng(seed)
    num_logical = 8 if (8 + redundant) % num_ranks == 0 else 9 - redundant % num_ranks
    loads = rng.exponential(size=(3, num_logical)) * rng.integers(1, 100, size=(3, 1))
    placement = rebalance_experts(loads, num_ranks, redundant)
    num_physical = num_logical + redundant
    assert placement.physical_to_logical.shape == (3, num_physical)
    assert (placement.logical_replica_count >= 1).all()
    assert (placement.logical_replica_count.sum(axis=1) == num_physical).all()
    for layer in range(3):
        p2l = placement.physical_to_logical[layer]
        for logical in range(num_logical):
            copies = placement.logical_to_physical[layer, logical]
            copies = copies[copies >= 0]
            assert len(copies) == placement.logical_replica_count[layer, logical]
            assert (p2l[copies] == logical).all()
    # Equal slots per rank: P / ranks each, and the rank loads add up to the total.
    per_rank = rank_loads(placement, loads, num_ranks)
    assert per_rank.shape == (3, num_ranks)
    np.testing.assert_allclose(per_rank.sum(axis=1), loads.sum(axis=1))
    assert (imbalance(per_rank) <= imbalance(rank_loads(
        default_placement(3, num_logical, num_ranks, redundant), loads, num_ranks)) + 1e-9).all()


def test_skewed_load_imbalance_drops():
    """2 hot experts of 8 on 2 ranks: the identity placement puts both on rank 0 (max/mean
    4/3); with 2 redundant experts EPLB splits them and balances the ranks."""
    identity = imbalance(rank_loads(default_placement(1, 8, 2, 0), SKEWED_LOAD, 2))
    placement = rebalance_experts(SKEWED_LOAD, 2, 2)
    balanced = imbalance(rank_loads(placement, SKEWED_LOAD, 2))
    np.testing.assert_allclose(identity, [4 / 3])
    assert list(placement.logical_replica_count[0, :2]) == [2, 2]
    # Excess over perfect balance (max/mean - 1) drops by >= 40% (here to 0).
    assert balanced[0] - 1 <= 0.6 * (identity[0] - 1)
    assert balanced[0] < 1.01


@pytest.mark.parametrize("seed", range(6))
def test_move_plan_reproduces_the_new_placement(seed):
    """Applying the planned copies to the old map gives the new one; unchanged slots are not
    copied; a copy crosses ranks only when the destination rank has no old copy; remote
    sends are spread over the ranks that hold the expert."""
    rng = np.random.default_rng(seed)
    num_ranks, redundant = (2, 3, 4)[seed % 3], (0, 12)[seed % 2]   # 12 or 24 physical
    loads = rng.integers(0, 100, size=(2, 12)).astype(np.float64)
    old = rebalance_experts(loads[:1], num_ranks, redundant).physical_to_logical[0]
    new = rebalance_experts(loads[1:], num_ranks, redundant).physical_to_logical[0]
    per_rank = old.size // num_ranks
    moves = plan_expert_moves(old, new, num_ranks)
    result = old.copy()
    for dst, src in moves:
        assert old[dst] != new[dst] and old[src] == new[dst]
        if src // per_rank != dst // per_rank:
            assert new[dst] not in old[dst // per_rank * per_rank:(dst // per_rank + 1) * per_rank]
        result[dst] = old[src]
    np.testing.assert_array_equal(result, new)
    assert plan_expert_moves(old, old, num_ranks) == []


def test_move_plan_refuses_bad_maps():
    with pytest.raises(ValueError, match="no old copy"):
        plan_expert_moves(np.array([0, 1, 1, 2]), np.array([0, 1, 3, 2]), 2)
    with pytest.raises(ValueError, match="over 3 ranks"):
        plan_expert_moves(np.arange(4), np.arange(4), 3)


@pytest.mark.parametrize("args, message", [
    ((np.ones((1, 8)), 3, 0), "not divisible by the 3"),
    ((np.ones((1, 8)), 2, -1), "num_redundant_experts"),
    ((-np.ones((1, 8)), 2, 0), "non-negative"),
    ((np.ones(8), 2, 0), r"\[num_layers, num_logical\]"),
])
def test_policy_refuses_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(*args)


def test_eplb_config_errors_name_the_field():
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        ParallelConfig(enable_eplb=True)
    with pytest.raises(ValueError, match="num_redundant_experts > 0 needs enable_eplb"):
        ParallelConfig(enable_expert_parallel=True, eplb_config=EPLBConfig(
            num_redundant_experts=2))
    with pytest.raises(ValueError, match="eplb_config.step_interval"):
        EPLBConfig(step_interval=0)
    with pytest.raises(ValueError, match="unknown keys"):
        EPLBConfig.from_dict({"window": 3})


# ---------------------------------------------------------------------------------- the layer

def test_redundant_experts_load_count_and_rebalance_keep_the_output():
    """A layer with 2 redundant experts (10 physical slots on one EP rank) equals the naive
    loop; its load counter sees every (token, expert) pair; a rebalance on a skewed router
    moves the hot experts' weights into replicas and the output stays the same."""
    torch.manual_seed(0)
    num_experts, hidden_size, inter, n, top_k = 8, 16, 12, 64, 2
    set_expert_parallel_layout(ExpertParallelLayout(True, 2, count_expert_load=True))
    try:
        layer = FusedMoE(num_experts, top_k, hidden_size, inter, renormalize=True)
    finally:
        set_expert_parallel_layout(ExpertParallelLayout())
    assert layer.num_physical_experts == layer.num_local_experts == 10
    w13 = torch.randn(num_experts, 2 * inter, hidden_size) / hidden_size ** 0.5
    w2 = torch.randn(num_experts, hidden_size, inter) / inter ** 0.5
    for e in range(num_experts):
        layer.weight_loader(layer.w13_weight, w13[e, :inter], "w1", e)
        layer.weight_loader(layer.w13_weight, w13[e, inter:], "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)
    # Slots 8, 9 hold replicas of logical 0, 1 (the default placement).
    assert torch.equal(layer.w13_weight[8], layer.w13_weight[0])
    hidden = torch.randn(n, hidden_size)
    logits = torch.randn(n, num_experts)
    logits[:, 5:7] += 3.0  # experts 5 and 6 are hot
    want = _naive_moe(hidden, logits, w13, w2, top_k, True)
    torch.testing.assert_close(layer(hidden, logits), want, atol=1e-5, rtol=1e-5)
    ids = torch.topk(logits, top_k, dim=-1).indices
    assert torch.equal(layer.expert_load, torch.bincount(ids.flatten(), minlength=num_experts))

    eplb = EplbState([layer], EPLBConfig(window_size=4, step_interval=2,
                                         num_redundant_experts=2), get_tp_group())
    assert not eplb.step()
    layer(hidden, logits)
    assert eplb.step()
    counts = layer.logical_replica_count.tolist()
    assert counts[5] == counts[6] == 2 and sum(counts) == 10
    assert eplb.num_rebalances == 1 and eplb.imbalance_before is not None
    for slot, logical in enumerate(layer.local_logical_ids().tolist()):
        assert torch.equal(layer.w13_weight[slot], w13[logical])
        assert torch.equal(layer.w2_weight[slot], w2[logical])
    torch.testing.assert_close(layer(hidden, logits), want, atol=1e-5, rtol=1e-5)


def test_take_expert_load_needs_counting():
    layer = FusedMoE(4, 2, 8, 6, True)
    with pytest.raises(RuntimeError, match="only with EPLB"):
        layer.take_expert_load()


# ---------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, byte_level_tokenizer_dir):
    return _build("mixtral", tmp_path_factory.mktemp("ep") / "mixtral", byte_level_tokenizer_dir)


PARAMS = [SamplingParams(max_tokens=12, temperature=0.0)]
EPLB = dict(enable_expert_parallel=True, enable_eplb=True,
            eplb_config={"window_size": 8, "step_interval": 3, "num_redundant_experts": 2})


def test_eplb_rebalancing_mid_run_changes_no_token(mixtral):
    """One process: 10 physical experts (2 redundant), a rebalance every 3 steps while the
    requests run; same greedy tokens as without EPLB."""
    from pagedllm import LLM
    from tests.distributed.common import ENGINE_ARGS, generate
    want = run(mixtral, PARAMS)
    llm = LLM(str(mixtral), **ENGINE_ARGS, **EPLB)
    try:
        got = [generate(llm, p) for p in PARAMS]
        eplb = llm.llm_engine.engine_core.executor.worker.model_runner.eplb
        assert eplb.num_rebalances >= 3
        assert eplb.imbalance_after is not None
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == want
    assert len(got[0]) == len(PROMPTS)


_NO_RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray not installed")


@pytest.mark.parametrize("parallel, backend", [
    pytest.param(dict(enable_expert_parallel=True), "mp", marks=pytest.mark.slow),
    (EPLB, "mp"),
    pytest.param(EPLB, "ray", marks=[pytest.mark.slow, _NO_RAY])])
def test_expert_parallel_tp2_matches_single_process(mixtral, parallel, backend):
    """Two workers (processes or Ray actors, gloo), 4 whole experts each (5 with EPLB's 2
    redundant), attention TP; with EPLB the experts that change place are sent point to point
    every 3 steps mid-run. Same greedy tokens as one process without EP."""
    got = run(mixtral, PARAMS, tensor_parallel_size=2, distributed_executor_backend=backend,
              **parallel)
    assert got == run(mixtral, PARAMS)


def test_eplb_with_spec_decode_preemption_and_prefix_caching(mixtral):
    """One process, EPLB rebalancing every 3 steps, n-gram speculative decoding, a KV cache of
    14 blocks of 8 tokens (preemption), prefix caching and a 24-token budget (chunked prefill):
    the same greedy tokens as the plain engine, and preemptions and cache hits did happen."""
    import random

    from pagedllm import LLM

    rng = random.Random(3)
    motif = [rng.randrange(300, 400) for _ in range(5)]
    shared = [rng.randrange(300, 400) for _ in range(16)]
    prompts = [{"prompt_token_ids": (shared if i % 2 else []) + motif * 3
                + [rng.randrange(300, 400) for _ in range(rng.randint(2, 9))]}
               for i in range(8)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    plain = LLM(str(mixtral), dtype="float32", num_gpu_blocks_override=64)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.llm_engine.engine_core.shutdown()
    llm = LLM(str(mixtral), dtype="float32", block_size=8, num_gpu_blocks_override=14,
              max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4}, **EPLB)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
        eplb = llm.llm_engine.engine_core.executor.worker.model_runner.eplb
        assert eplb.num_rebalances >= 2
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_cache_stats.hits > 0
