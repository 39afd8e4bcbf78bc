"""Prefix caching mode "align" on hybrid models (core/state_cache_group_manager.py): a prompt
that shares its first blocks with an earlier one resumes from the earlier one's state checkpoint
at the longest block boundary both the attention blocks and a checkpoint cover, and gives the
tokens and logprobs (within 1e-4) of an engine without prefix caching; the OpenAI server reports
the hit in `usage.prompt_tokens_details.cached_tokens`. (A repeated batch against HF, with
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


def _run(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


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
    for got, want in zip(hits, _run(plain, second)):
        got, want = got.outputs[0], want.outputs[0]
        assert list(got.token_ids) == list(want.token_ids)
        for step_got, step_want, t in zip(got.logprobs, want.logprobs, got.token_ids):
            assert abs(step_got[t].logprob - step_want[t].logprob) <= LOGPROB_TOL
    groups = cached.llm_engine.engine_core.scheduler.kv_cache_manager.groups
    assert all(not g.req_to_blocks for g in groups)


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
