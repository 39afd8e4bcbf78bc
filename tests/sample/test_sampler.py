"""Sampler with fixed logits and seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.ops.penalties import apply_penalties
from pagedllm.sample.ops.topk_topp import apply_min_p, apply_top_k_top_p
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import RequestStates
from pagedllm.worker.sampling_inputs import build_sampling_metadata
from pagedllm.core.sched_output import NewRequestData

V = 32


def _metadata(params: list[SamplingParams], prompts: list[list[int]] | None = None,
              outputs: list[list[int]] | None = None):
    states = RequestStates(len(params), 64, 4, 16)
    prompts = prompts or [[1, 2, 3]] * len(params)
    outputs = outputs or [[]] * len(params)
    for i, sp in enumerate(params):
        sp.update_from_generation_config((0,))
        states.add_request(NewRequestData(str(i), prompts[i], outputs[i], sp, [1], 0))
    rows = np.array([states.req_id_to_index[str(i)] for i in range(len(params))])
    return build_sampling_metadata(states, rows, V, torch.device("cpu"))


def _sample(logits, md, seed=0):
    return Sampler(torch.device("cpu"), seed=seed)(logits, md).sampled_token_ids


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    md = _metadata([SamplingParams(temperature=0.0)] * 3)
    assert torch.equal(_sample(logits, md), logits.argmax(-1))


def test_plain_greedy_fast_path_equals_the_general_path():
    """Rows that are plain argmax take build_sampling_metadata's fast path; greedy rows with
    anything that edits the logits or asks for logprobs do not, and both sample as the general
    path does."""
    plain = [SamplingParams(temperature=0.0, top_p=0.5, seed=3), SamplingParams(temperature=0.0)]
    md = _metadata(plain)
    assert md.all_greedy and md.top_p is None and md.max_num_logprobs is None
    logits = torch.randn(2, V)
    assert torch.equal(_sample(logits, md), logits.argmax(-1))
    for edited in (SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
                   SamplingParams(temperature=0.0, repetition_penalty=1.5),
                   SamplingParams(temperature=0.0, logprobs=2),
                   SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
                   SamplingParams(temperature=0.0, allowed_token_ids=[4, 9])):
        md = _metadata([SamplingParams(temperature=0.0), edited])
        got = _sample(logits, md)
        assert got[0] == logits[0].argmax()
        assert md.logit_bias_rows is not None or md.repetition_penalties is not None or \
            md.max_num_logprobs == 2 or md.banned_rows is not None or \
            md.allowed_token_mask is not None
    md = _metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0,
                                                                      logit_bias={5: 100.0})])
    assert _sample(logits, md)[1] == 5


def test_random_sampling_follows_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-30).log().repeat(4000, 1)
    md = _metadata([SamplingParams(temperature=1.0)] * 4000)
    counts = torch.bincount(_sample(logits, md, seed=1), minlength=V)
    freq = counts.float() / 4000
    assert torch.allclose(freq[:3], probs[:3], atol=0.03)
    assert counts[3:].sum() == 0


def test_seed_and_position_determine_the_sample():
    logits = torch.randn(1, V).repeat(3, 1)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=1.0, seed=8)]
    sampler = Sampler(torch.device("cpu"))
    first = [sampler(logits, _metadata([SamplingParams(temperature=1.0, seed=s)] * 3))
             .sampled_token_ids.tolist() for s in (7, 7)]
    assert first[0] == first[1]
    many = {tuple(sampler(logits, _metadata([SamplingParams(temperature=1.0, seed=s)]))
                  .sampled_token_ids.tolist()) for s in range(20)}
    assert len(many) > 1
    tokens = sampler(logits, _metadata(params)).sampled_token_ids
    assert tokens[0] == tokens[1]


def test_top_k_top_p_min_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(apply_top_k_top_p(logits, torch.tensor([2]), None)[0, 2:]).all()
    p = logits.softmax(-1)[0]
    out = apply_top_k_top_p(logits, None, torch.tensor([float(p[0] + 0.01)]))
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()
    out = apply_min_p(logits, torch.tensor([0.3]))
    keep = p >= 0.3 * p.max()
    assert torch.equal(torch.isfinite(out[0]), keep)


def test_penalties_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    prompt = torch.tensor([[0, 4]])      # token 0 seen in the prompt; 4 = padding
    output = torch.tensor([[1, 1, 4]])   # token 1 generated twice
    out = apply_penalties(logits.clone(), prompt, output, torch.tensor([0.5]),
                          torch.tensor([0.25]), torch.tensor([2.0]))
    assert out[0].tolist() == pytest.approx([1.0, -4.0 - 0.5 - 0.5, 1.0, 1.0])


def test_min_tokens_masks_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 0] = 100.0      # EOS (id 0) would win
    md = _metadata([SamplingParams(temperature=0.0, min_tokens=2)])
    assert _sample(logits, md).item() != 0
    md = _metadata([SamplingParams(temperature=0.0, min_tokens=2)], outputs=[[5, 6]])
    assert _sample(logits, md).item() == 0
