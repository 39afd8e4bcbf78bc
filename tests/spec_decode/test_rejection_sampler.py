"""The rejection sampler leaves the target distribution unchanged (chi-square), with one-hot and
with general draft distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection_sampler import rejection_sample
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.metadata import build_spec_decode_metadata

V, K = 6, 2


def _metadata(n: int, temperature: float = 1.0) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((n,), temperature), all_greedy=temperature == 0,
        all_random=temperature > 0, top_p=None, top_k=None, min_p=None, seeded_rows=[],
        seeds=[], output_positions=[], presence_penalties=None, frequency_penalties=None,
        repetition_penalties=None, prompt_token_ids=None, output_token_ids=None,
        banned_rows=None, banned_token_ids=None)


@pytest.mark.parametrize("general_q", [False, True])
def test_first_token_follows_target(general_q):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])     # a poor draft: differs from p
    trials = 6000
    # Each trial is one request with K drafts drawn from q (one-hot: a fixed draft token).
    draft_tokens = (rng.choice(V, size=(trials, K), p=q.numpy()) if general_q
                    else np.full((trials, K), 2))
    spec = build_spec_decode_metadata([list(d) for d in draft_tokens],
                                      np.arange(trials) * (K + 1) + K)
    logits = p.log().repeat(trials * (K + 1), 1)
    draft_probs = q.repeat(trials * K, 1) if general_q else None
    sampler = Sampler(torch.device("cpu"), seed=1)
    emitted, _, _ = rejection_sample(sampler, logits, _metadata(trials * (K + 1)), spec,
                                     draft_probs)
    first = np.array([e[0] for e in emitted])
    observed = np.bincount(first, minlength=V)
    expected = p.double().numpy() / p.double().sum().item() * trials
    chi2 = stats.chisquare(observed, expected)
    assert chi2.pvalue > 1e-3, (observed, expected)
    # And clearly not the draft's distribution.
    if general_q:
        assert stats.chisquare(observed, q.double().numpy() / q.double().sum().item()
                               * trials).pvalue < 1e-6


def test_greedy_accepts_matching_prefix():
    logits = torch.full((4, V), -5.0)
    target = [3, 1, 4, 2]
    logits[torch.arange(4), torch.tensor(target)] = 5.0
    spec = build_spec_decode_metadata([[3, 1, 5]], np.array([3]))
    emitted, _, _ = rejection_sample(Sampler(torch.device("cpu")), logits, _metadata(4, 0.0),
                                      spec)
    assert emitted == [[3, 1, 4]]
    spec = build_spec_decode_metadata([[3, 1, 4]], np.array([3]))
    emitted, _, _ = rejection_sample(Sampler(torch.device("cpu")), logits, _metadata(4, 0.0),
                                      spec)
    assert emitted == [[3, 1, 4, 2]]
