"""Rejection sampler for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

For draft token d at a position with target distribution p and proposal distribution q:
accept with probability min(1, p(d) / q(d)); at the first rejection emit a token drawn from
normalize(max(p - q, 0)); if all k drafts are accepted, emit a bonus token drawn from p at the
last position. The emitted tokens are then distributed exactly as sampling from p step by step.
Greedy rows accept while the draft equals the target argmax, then emit the argmax.

Our proposers are deterministic (n-gram lookup, greedy draft model), so q is one-hot at d:
accept with probability p(d), and on rejection draw from p with d removed. A general q can be
passed (`draft_probs`) and is what the distribution test exercises.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Distributions, Sampler
from pagedllm.spec_decode.metadata import SpecDecodeMetadata

_ACCEPT_STREAM, _RECOVER_STREAM = 1, 2


def rejection_sample(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata,
                     spec: SpecDecodeMetadata, draft_probs: torch.Tensor | None = None
                     ) -> tuple[list[list[int]], Distributions, torch.Tensor]:
    """Verify drafts.

    Args:
        logits: [N, V] target logits, N = spec.num_logits (row b's rows are
            [cu_num_logits[b], cu_num_logits[b+1])).
        md: sampling metadata with one row per logits row (the request's parameters repeated,
            output positions advanced along the drafts).
        spec: where drafts and bonus positions are.
        draft_probs: [total_drafts, V] proposal distributions, or None for one-hot proposals.

    Returns:
        (emitted tokens per row, the target distributions, per-logits-row emitted-or-candidate
        tokens [N] (for logprobs)).
    """
    dist = sampler.distributions(logits, md)
    device = logits.device
    n = logits.shape[0]
    is_bonus = np.zeros(n, dtype=bool)
    is_bonus[spec.cu_num_logits[1:] - 1] = True
    # Draft token verified at each non-bonus logits row.
    drafts = np.zeros(n, dtype=np.int64)
    drafts[~is_bonus] = spec.draft_token_ids
    drafts_t = torch.from_numpy(drafts).to(device)
    is_bonus_t = torch.from_numpy(is_bonus).to(device)

    greedy_rows = md.temperature == 0
    accept = torch.zeros(n, dtype=torch.bool, device=device)
    candidate = torch.zeros(n, dtype=torch.int64, device=device)
    if dist.greedy is not None:
        accept |= greedy_rows & (drafts_t == dist.greedy)
        candidate = torch.where(greedy_rows, dist.greedy, candidate)
    if dist.probs is not None:
        p = dist.probs
        p_draft = p.gather(1, drafts_t[:, None])[:, 0]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
            q = torch.zeros_like(p).scatter_(1, drafts_t[:, None], 1.0)
        else:
            q = torch.zeros_like(p)
            q[~is_bonus_t] = draft_probs.to(p.dtype)
            q_draft = q.gather(1, drafts_t[:, None])[:, 0]
        u = sampler.noise(p_draft, md, _ACCEPT_STREAM, exponential=False)
        accept_random = u * q_draft < p_draft           # u < p/q without dividing by 0
        residual = torch.where(is_bonus_t[:, None], p, (p - q).clamp_min(0.0))
        # A residual with no mass only happens when p(d) >= q(d) everywhere, i.e. never rejects.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        recovered = sampler.race(residual, md, _RECOVER_STREAM)
        random_rows = ~greedy_rows
        accept |= random_rows & accept_random
        candidate = torch.where(random_rows, recovered, candidate)

    accept_np = accept.cpu().numpy()
    candidate_np = candidate.cpu().numpy()
    emitted: list[list[int]] = []
    for b in range(len(spec.num_draft_tokens)):
        lo, hi = int(spec.cu_num_logits[b]), int(spec.cu_num_logits[b + 1])
        out = []
        for j in range(lo, hi):
            if j < hi - 1 and accept_np[j]:
                out.append(int(drafts[j]))
                continue
            out.append(int(candidate_np[j]))
            break
        emitted.append(out)
    # The token emitted (or that would be) at each logits row, for logprobs.
    emitted_at_row = torch.where(accept & ~is_bonus_t, drafts_t, candidate)
    return emitted, dist, emitted_at_row
