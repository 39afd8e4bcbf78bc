"""The synthetic workload is a pure function of its spec and respects its bounds."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.workload import (WorkloadSpec, make_workload, parse_len_range,
                                          sampling_params_for)


def _spec(**overrides) -> WorkloadSpec:
    kwargs = dict(num_prompts=16, vocab_size=32000, random_input_len=(32, 512),
                  random_output_len=(32, 256), seed=7)
    kwargs.update(overrides)
    return WorkloadSpec(**kwargs)


def test_same_seed_same_workload():
    assert make_workload(_spec()) == make_workload(_spec())


def test_different_seed_different_workload():
    a, b = make_workload(_spec(seed=1)), make_workload(_spec(seed=2))
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in b]
    assert [r.output_len for r in a] != [r.output_len for r in b]


def test_random_lengths_and_ids_within_bounds():
    spec = _spec(num_prompts=200)
    requests = make_workload(spec)
    in_lens = [len(r.prompt_token_ids) for r in requests]
    out_lens = [r.output_len for r in requests]
    assert 32 <= min(in_lens) and max(in_lens) <= 512
    assert 32 <= min(out_lens) and max(out_lens) <= 256
    assert len(set(in_lens)) > 20 and len(set(out_lens)) > 20  # actually random
    ids = [t for r in requests for t in r.prompt_token_ids]
    assert spec.effective_token_low <= min(ids) and max(ids) < spec.vocab_size


def test_fixed_lengths():
    requests = make_workload(WorkloadSpec(num_prompts=5, vocab_size=1024, input_len=9,
                                          output_len=3, seed=0))
    assert [len(r.prompt_token_ids) for r in requests] == [9] * 5
    assert [r.output_len for r in requests] == [3] * 5
    assert min(t for r in requests for t in r.prompt_token_ids) >= 1024 // 4


def test_inclusive_range_of_one_value():
    requests = make_workload(_spec(random_input_len=(4, 4), random_output_len=(2, 2)))
    assert {len(r.prompt_token_ids) for r in requests} == {4}
    assert {r.output_len for r in requests} == {2}


def test_sampling_params_give_exact_lengths():
    request = make_workload(_spec(num_prompts=1))[0]
    params = sampling_params_for(request)
    assert params.max_tokens == request.output_len and params.ignore_eos
    assert params.temperature == 0.0


@pytest.mark.parametrize("text", ["5", "a:b", "0:3", "9:3", "1:2:3"])
def test_parse_len_range_rejects(text):
    with pytest.raises(ValueError):
        parse_len_range(text)


def test_parse_len_range():
    assert parse_len_range("32:512") == (32, 512)
    assert parse_len_range(None) is None


def test_spec_validation():
    with pytest.raises(ValueError, match="num_prompts"):
        WorkloadSpec(num_prompts=0, vocab_size=100)
    with pytest.raises(ValueError, match="random_input_len"):
        WorkloadSpec(num_prompts=1, vocab_size=100, random_input_len=(5, 2))
