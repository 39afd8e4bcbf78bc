"""Paged SDPA backend against dense causal attention on random mixed batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.metadata import CommonAttentionMetadata


def _dense(q, k, v, scale):
    """q [Q, H, D] at the end of k/v [S, KVH, D]: causal attention, GQA by repetition."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n_q, n_k = q.shape[0], k.shape[0]
    mask = torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("seed", range(5))
def test_matches_dense(seed):
    rng = np.random.default_rng(seed)
    H, KVH, D, bs, num_blocks = 4, 2, 8, 4, 64
    num_reqs = 5
    ctx = rng.integers(0, 20, num_reqs)                # cached tokens per request
    q_lens = np.where(rng.random(num_reqs) < 0.5, 1, rng.integers(1, 12, num_reqs))
    seq_lens = ctx + q_lens
    kv_cache = torch.zeros(2, num_blocks, bs, KVH, D)
    perm = rng.permutation(np.arange(1, num_blocks))
    max_blocks = int(-(-seq_lens.max() // bs))
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    full_k, full_v, used = [], [], 0
    for r in range(num_reqs):
        nb = -(-seq_lens[r] // bs)
        block_table[r, :nb] = perm[used:used + nb]
        used += nb
        full_k.append(torch.randn(seq_lens[r], KVH, D))
        full_v.append(torch.randn(seq_lens[r], KVH, D))
        for p in range(ctx[r]):  # pre-fill the cached context
            b, o = block_table[r, p // bs], p % bs
            kv_cache[0, b, o], kv_cache[1, b, o] = full_k[r][p], full_v[r][p]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    slots = np.concatenate([block_table[r, np.arange(ctx[r], seq_lens[r]) // bs].astype(np.int64)
                            * bs + np.arange(ctx[r], seq_lens[r]) % bs for r in range(num_reqs)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        seq_lens_cpu=seq_lens.astype(np.int32), block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots), num_reqs=num_reqs, num_actual_tokens=int(qsl[-1]),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()), block_size=bs)
    qs = [torch.randn(q_lens[r], H, D) for r in range(num_reqs)]
    new_k = torch.cat([full_k[r][ctx[r]:] for r in range(num_reqs)])
    new_v = torch.cat([full_v[r][ctx[r]:] for r in range(num_reqs)])
    out = TorchSDPABackend.forward(torch.cat(qs), new_k, new_v, kv_cache,
                                   TorchSDPABackend.build_metadata(common), D ** -0.5)
    want = torch.cat([_dense(qs[r], full_k[r], full_v[r], D ** -0.5) for r in range(num_reqs)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
