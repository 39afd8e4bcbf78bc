"""Both paged attention backends against dense causal attention on random mixed batches
(decodes, first prefill chunks, later chunks over a cached context; MHA, GQA and MQA), with and
without a sliding window and attention-logit soft-capping (Gemma), and with bidirectional image
spans (`attend_until`, Gemma 3)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.metadata import CommonAttentionMetadata


def _dense(q, k, v, scale, window=None, soft_cap=None, horizon=None):
    """q [Q, H, D] at the end of k/v [S, KVH, D]: causal attention, GQA by repetition. A window
    keeps key positions > query position - window (HF's sliding-window mask); soft_cap maps
    scores s to cap * tanh(s / cap); horizon [Q]: each query's last visible key position in
    place of its own (image tokens seeing their whole image)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    n_q, n_k = q.shape[0], k.shape[0]
    k_pos, q_pos = torch.arange(n_k)[None, :], (n_k - n_q + torch.arange(n_q))[:, None]
    mask = k_pos <= (q_pos if horizon is None else horizon[:, None])
    if window is not None:
        mask &= k_pos > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


BACKENDS = [TorchSDPABackend,
            pytest.param(CpuPagedBackend, marks=pytest.mark.skipif(
                not CpuPagedBackend.is_available(), reason="CPU kernels did not build"))]
# (heads, kv heads, head size, block size)
SHAPES = [(4, 2, 8, 4), (6, 6, 64, 16), (8, 1, 16, 8), (12, 12, 16, 4), (14, 7, 8, 4),
          (4, 2, 128, 16), (6, 3, 40, 8)]


def _run_random_step(backend, shape, dtype, num_reqs, seed, window=None, soft_cap=None,
                     max_query_len=12, images=False):
    """One random mixed step through `backend`, checked against `_dense` per request; with
    `images` a random image span in every request of 3 or more query tokens (its tokens attend
    up to its last one, `attend_until`)."""
    rng = np.random.default_rng(seed)
    H, KVH, D, bs = shape
    num_blocks = 80
    ctx = rng.integers(0, 40, num_reqs) * (rng.random(num_reqs) < 0.7)  # cached tokens
    q_lens = np.where(rng.random(num_reqs) < 0.5, 1, rng.integers(1, max_query_len, num_reqs))
    seq_lens = ctx + q_lens
    kv_cache = torch.zeros(2, num_blocks, bs, KVH, D, dtype=dtype)
    perm = rng.permutation(np.arange(1, num_blocks))
    max_blocks = int(-(-seq_lens.max() // bs))
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    full_k, full_v, used = [], [], 0
    for r in range(num_reqs):
        nb = -(-seq_lens[r] // bs)
        block_table[r, :nb] = perm[used:used + nb]
        used += nb
        full_k.append(torch.randn(seq_lens[r], KVH, D).to(dtype))
        full_v.append(torch.randn(seq_lens[r], KVH, D).to(dtype))
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
    horizons = [torch.arange(ctx[r], seq_lens[r]) for r in range(num_reqs)]
    if images:
        for r in np.nonzero(q_lens >= 3)[0]:
            first = int(rng.integers(0, q_lens[r] - 2))
            last = int(rng.integers(first + 1, q_lens[r]))
            horizons[r][first:last + 1] = ctx[r] + last
        common = replace(common, attend_until=torch.cat(horizons))
    qs = [torch.randn(q_lens[r], H, D).to(dtype) for r in range(num_reqs)]
    new_k = torch.cat([full_k[r][ctx[r]:] for r in range(num_reqs)])
    new_v = torch.cat([full_v[r][ctx[r]:] for r in range(num_reqs)])
    out = backend.forward(torch.cat(qs), new_k, new_v, kv_cache,
                          backend.build_metadata(common), D ** -0.5, sliding_window=window,
                          logits_soft_cap=soft_cap)
    assert out.dtype == dtype
    want = torch.cat([_dense(qs[r].float(), full_k[r].float(), full_v[r].float(), D ** -0.5,
                             window, soft_cap, horizons[r] if images else None)
                      for r in range(num_reqs)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    # the new tokens' K/V landed in their slots
    torch.testing.assert_close(kv_cache[0].view(-1, KVH, D)[common.slot_mapping], new_k)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_reqs", [1, 6])  # few tokens: the kernel splits the KV heads
@pytest.mark.parametrize("seed", range(3))
def test_matches_dense(backend, shape, dtype, num_reqs, seed):
    _run_random_step(backend, shape, dtype, num_reqs, seed)


# (heads, kv heads, head size, block size): windows inside one block, across blocks, and
# longer than every sequence.
WINDOW_SHAPES = [(4, 2, 16, 4), (6, 3, 32, 16), (3, 1, 8, 8)]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=str)
@pytest.mark.parametrize("window,soft_cap", [(1, None), (3, None), (17, None), (100, None),
                                             (None, 2.0), (5, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_window_and_soft_cap_match_dense(backend, shape, window, soft_cap, dtype):
    # Prefill chunks up to 30 tokens, so fresh requests longer than the window take the kernel.
    _run_random_step(backend, shape, dtype, 6, 0, window=window, soft_cap=soft_cap,
                     max_query_len=30)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("shape,window,soft_cap", [((4, 2, 32, 16), None, None),
                                                   ((6, 3, 32, 8), 8, None),
                                                   ((8, 1, 16, 4), None, 3.0)], ids=str)
@pytest.mark.parametrize("seed", range(2))
def test_image_spans_match_dense(backend, shape, window, soft_cap, seed, monkeypatch):
    """Bidirectional image spans in fresh prompts, later chunks and beside decodes; cpu_paged
    computes them in its kernel (fresh prompts without images stay on SDPA), never through
    torch_sdpa."""
    if backend is CpuPagedBackend:
        def no_fallback(*args, **kwargs):
            raise AssertionError("cpu_paged fell back to torch_sdpa")
        monkeypatch.setattr(TorchSDPABackend, "forward", no_fallback)
    _run_random_step(backend, shape, torch.float32, 8, seed, window=window, soft_cap=soft_cap,
                     max_query_len=30, images=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_non_causal_prefill_attends_to_the_whole_sequence(backend, heads, kv_heads):
    """Encoder-style steps (causal=False): every token sees its request's whole sequence, with
    GQA folding query heads (a [G, 1, S] mask once failed to repeat over the query axis)."""
    torch.manual_seed(0)
    D, bs, lens = 16, 4, [5, 9, 1]
    blocks = [-(-n // bs) for n in lens]
    block_table = np.zeros((len(lens), max(blocks)), dtype=np.int32)
    first = 1
    for r, nb in enumerate(blocks):
        block_table[r, :nb] = np.arange(first, first + nb)
        first += nb
    slots = np.concatenate([block_table[r, np.arange(n) // bs].astype(np.int64) * bs
                            + np.arange(n) % bs for r, n in enumerate(lens)])
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq_lens = np.array(lens, dtype=np.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens), seq_lens_cpu=seq_lens,
        block_table=torch.from_numpy(block_table), slot_mapping=torch.from_numpy(slots),
        num_reqs=len(lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(lens),
        max_seq_len=max(lens), block_size=bs, causal=False)
    n = int(qsl[-1])
    q, k, v = torch.randn(n, heads, D), torch.randn(n, kv_heads, D), torch.randn(n, kv_heads, D)
    cache = torch.zeros(2, first, bs, kv_heads, D)
    out = backend.forward(q, k, v, cache, backend.build_metadata(common), D ** -0.5)
    rep = heads // kv_heads
    for r in range(len(lens)):
        rows = slice(qsl[r], qsl[r + 1])
        kr, vr = k[rows].repeat_interleave(rep, 1), v[rows].repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows], kr) * D ** -0.5
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr)
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
