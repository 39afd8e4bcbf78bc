"""Pipeline parallelism end to end: pp=2 (and tp=2 x pp=2) over worker processes equals the
single-process engine: greedy and seeded tokens, with chunked prefill and a tied LM head held
by the last stage."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.layers.pipeline import get_pp_indices
from tests.distributed.common import run

PARAMS = [SamplingParams(max_tokens=8, temperature=0.0),
          SamplingParams(max_tokens=6, temperature=1.0, seed=11)]


@pytest.mark.parametrize("variant, layout", [
    ("llama", dict(pipeline_parallel_size=2)),
    ("llama_mqa_tied_llama3", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),
])
def test_pipeline_parallel_matches_single_process(tiny_checkpoints, variant, layout):
    path = tiny_checkpoints[variant]
    assert run(path, PARAMS, **layout) == run(path, PARAMS)


def test_pp_indices_cover_every_layer_once():
    assert [get_pp_indices(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [get_pp_indices(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="cannot be split"):
        get_pp_indices(2, 0, 3)
