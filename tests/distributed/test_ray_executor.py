"""Tensor parallelism through Ray actors: tp=2 on a local Ray instance equals tp=1.

Marked slow: starting Ray takes 30-60 s on a small machine. Skipped when Ray is not installed.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.distributed.common import ENGINE_ARGS, PROMPTS

pytest.importorskip("ray")


@pytest.mark.slow
def test_tp2_ray_matches_tp1(tiny_checkpoints):
    path = str(tiny_checkpoints["llama_mqa_tied_llama3"])
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref = LLM(path, **ENGINE_ARGS)
    expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(path, **ENGINE_ARGS, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == expected
