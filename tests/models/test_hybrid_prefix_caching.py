"""Prefix caching mode "align" on hybrid models (core/state_cache_group_manager.py): a prompt
that shares its first blocks with an earlier one resumes from the earlier one's state checkpoint
at the longest block boundary both the attention blocks and a checkpoint cover, and gives the
tokens and logprobs (within 1e-4) of an engine without prefix caching; the OpenAI server reports
the hit in `usage.prompt_tokens_details.cached_tokens`. The block boundaries inside one long
prefill step and inside a multi-step decode round are checkpoints too (the scans emit their
states). (A repeated batch against HF, with
chunked prefill and preemption: tests/models/test_hybrid_models.py.)
"""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app
from tests.models.test_hybrid_models import hybrid_checkpoints  # noqa: F401 (a fixture)

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_seqs=8)
LOGPROB_TOL = 1e-4


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """(first batch, second batch): the second's prompts share 40 and 20 leading tokens with
    the first's, then differ."""
    rng = random.Random(1)
    first = [[rng.randrange(3, 250) for _ in range(n)] for n in (70, 45)]
    second = [first[0][:40] + [rng.randrange(3, 250) for _ in range(25)],
              first[1][:20] + [rng.randrange(3, 250) for _ in range(30)]]
    return first, second


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = 6):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_same_outputs(hits, plain_outputs) -> None:
    for got, want in zip(hits, plain_outputs):
        got, want = got.outputs[0], want.outputs[0]
        assert list(got.token_ids) == list(want.token_ids)
        for step_got, step_want, t in zip(got.logprobs, want.logprobs, got.token_ids):
            assert abs(step_got[t].logprob - step_want[t].logprob) <= LOGPROB_TOL


@pytest.mark.parametrize("model", ["mamba2", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_partial_prefix_hit_matches_no_prefix_caching(hybrid_checkpoints, model):  # noqa: F811
    """Budget 32: the first batch's prefills end at 32 and 64 (checkpoints there), so the
    second batch hits 32 of its 40 shared tokens and 16 of its 20 (block_size 16)."""
    first, second = _prompts()
    path = str(hybrid_checkpoints[model])
    cached = LLM(path, max_num_batched_tokens=32, **ENGINE_ARGS)
    _run(cached, first)
    hits = _run(cached, second)
    assert [o.num_cached_tokens for o in hits] == [32, 16]
    plain = LLM(path, max_num_batched_tokens=32, enable_prefix_caching=False, **ENGINE_ARGS)
    _assert_same_outputs(hits, _run(plain, second))
    groups = cached.llm_engine.engine_core.scheduler.kv_cache_manager.groups
    assert all(not g.req_to_blocks for g in groups)


@pytest.mark.parametrize("model", ["mamba2", "qwen3_next"])
def test_boundaries_inside_one_prefill_step_are_hits(hybrid_checkpoints, model):  # noqa: F811
    """Unchunked: the first batch's prompts (70 and 45 tokens) are prefilled in one step each
    up to their last boundary ([0, 64), [0, 32)); the scans emit the states at 16, 32 and 48
    (and 16) on the way, so the second batch, sharing 40 and 20 tokens, hits 2 and 1 blocks
    (only 64 and 32 were checkpoints before) with the outputs of an engine without caching."""
    first, second = _prompts()
    path = str(hybrid_checkpoints[model])
    cached = LLM(path, **ENGINE_ARGS)
    _run(cached, first)
    hits = _run(cached, second)
    assert [o.num_cached_tokens for o in hits] == [32, 16]
    plain = LLM(path, enable_prefix_caching=False, **ENGINE_ARGS)
    _assert_same_outputs(hits, _run(plain, second))


def test_decode_boundaries_inside_a_multi_step_round_are_hits(hybrid_checkpoints):  # noqa: F811
    """A 10-token prompt decodes 40 tokens in rounds of up to 16 steps ([10, 26), [26, 42),
    [42, 49)): the boundaries 16 and 32 fall inside rounds, after their first steps. A prompt
    sharing the first 36 tokens (prompt and outputs) hits 32 (the attention groups cache a
    round's blocks at the request's next step, so the round is not its last)."""
    path = str(hybrid_checkpoints["mamba2"])
    cached = LLM(path, num_scheduler_steps=16, **ENGINE_ARGS)
    prompt = [7 + (i * 13) % 200 for i in range(10)]
    out = _run(cached, [prompt], max_tokens=40)[0].outputs[0]
    second = [prompt + list(out.token_ids[:26]) + [3, 4, 5, 6, 7]]
    hits = _run(cached, second)
    assert [o.num_cached_tokens for o in hits] == [32]
    plain = LLM(path, enable_prefix_caching=False, **ENGINE_ARGS)
    _assert_same_outputs(hits, _run(plain, second))


def test_mode_none_gives_no_hits(hybrid_checkpoints):  # noqa: F811
    llm = LLM(str(hybrid_checkpoints["mamba2"]), mamba_cache_mode="none", **ENGINE_ARGS)
    first, _ = _prompts()
    want = _run(llm, first)
    again = _run(llm, first)
    assert [o.num_cached_tokens for o in again] == [0, 0]
    assert [list(o.outputs[0].token_ids) for o in again] == [
        list(o.outputs[0].token_ids) for o in want]


def test_server_usage_reports_cached_tokens(hybrid_checkpoints):  # noqa: F811
    """A repeated 40-token prompt on Mamba-2 (no attention layers): 32 cached tokens."""
    async_llm = AsyncLLM.from_engine_args(str(hybrid_checkpoints["mamba2"]), **ENGINE_ARGS)
    with TestClient(build_app(async_llm, ["mamba"])) as client:
        body = {"model": "mamba", "prompt": [5 + i % 50 for i in range(40)], "max_tokens": 2,
                "temperature": 0}
        first = client.post("/v1/completions", json=body)
        second = client.post("/v1/completions", json=body)
        assert first.status_code == second.status_code == 200, second.text
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        usage = second.json()["usage"]
        assert usage["prompt_tokens"] == 40
        assert usage["prompt_tokens_details"]["cached_tokens"] == 32
