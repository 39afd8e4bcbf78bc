"""The DSA decode kernels (csrc/cpu_dsa.cpp) against the torch reference ops (dsa_torch.py), and
the indexer's Hadamard rotation against the explicit Sylvester matrix.

Oracles: `indexer_scores` + `select_topk` for the kernel's top-k (as score multisets, so that
ties may fall either way), `sparse_mla_absorbed` for the sparse MLA kernel, and
`DSATorchBackend.forward` for `DSACpuBackend.forward` on mixed steps (decode rows and
prefill chunks, one kernel row per query token), with float and C8 indexer caches and several requests whose
contexts are below, at and above index_topk, scattered over shuffled blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.backends import dsa_cpu
from pagedllm.attention.backends.dsa_cpu import DSACpuBackend
from pagedllm.attention.backends.dsa_torch import (DSATorchBackend, IndexerInputs,
                                                   hadamard_transform, indexer_scores,
                                                   rotate_for_cache, select_topk,
                                                   sparse_mla_absorbed)
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.indexer_cache_layout import (allocate_indexer_cache, read_indexer_keys,
                                           write_indexer_keys)
from pagedllm.kv_cache_layout import allocate_kv_cache, write_cache_rows
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.dsa import dsa_indexer_topk, dsa_sparse_mla_decode

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

# heads, kv_lora_rank, rope dim, dn = dv, indexer heads, index_head_dim, index_topk, block size
H, L, DR, DN, HI, D, TOPK, BS = 4, 32, 8, 16, 8, 16, 8, 4
NUM_BLOCKS = 96
C8 = (torch.int8, torch.float8_e4m3fn)


def test_hadamard_transform_is_the_orthonormal_sylvester_rotation():
    h = torch.ones(1, 1)
    while h.shape[0] < D:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(3, 5, D)
    torch.testing.assert_close(hadamard_transform(x), x @ h * D ** -0.5)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x)
    q, k = torch.randn(7, D), torch.randn(9, D)
    torch.testing.assert_close(hadamard_transform(q) @ hadamard_transform(k).T, q @ k.T)
    with pytest.raises(ValueError, match="index_head_dim a power of two, got 24"):
        hadamard_transform(torch.randn(2, 24))


def test_c8_keys_are_rotated_and_queries_match_them():
    """A C8 cache holds the rotated keys (an outlier channel spreads over all D values, so
    the int8 step shrinks and the scores' error with it); a float cache the keys as they are."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(64, D, generator=gen)
    k[:, 3] *= 30                                           # one outlier channel
    q = torch.randn(1, HI, D, generator=gen)
    exact = torch.einsum("hd,sd->hs", q[0], k)
    errors = {}
    for rotate in (False, True):
        cache = allocate_indexer_cache(NUM_BLOCKS, BS, D, torch.int8, torch.device("cpu"))
        inputs = IndexerInputs(q, k, torch.ones(1, HI), cache, 1.0, TOPK)
        if rotate:
            inputs = rotate_for_cache(inputs)
        write_indexer_keys(cache, inputs.k, torch.arange(4, 68))
        keys = read_indexer_keys(cache, torch.arange(4, 68))
        errors[rotate] = (torch.einsum("hd,sd->hs", inputs.q[0], keys) - exact).abs().max()
    assert errors[True] < errors[False] / 2
    float_cache = allocate_indexer_cache(NUM_BLOCKS, BS, D, torch.float32, torch.device("cpu"))
    same = rotate_for_cache(IndexerInputs(q, k, torch.ones(1, HI), float_cache, 1.0, TOPK))
    assert same.q is q and same.k is k


def _step(seq_lens, q_lens, seed):
    """Random paged caches' contents and a step's metadata: request r has seq_lens[r] tokens,
    the last q_lens[r] new (in the step). Returns (common, latents per request [S, L + dr],
    indexer keys per request [S, D], block table numpy)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, NUM_BLOCKS))
    seq_lens, q_lens = np.asarray(seq_lens), np.asarray(q_lens)
    max_blocks = int(-(-seq_lens.max() // BS))
    table = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        nb = -(-s // BS)
        table[r, :nb] = perm[used:used + nb]
        used += nb
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    new_pos = [np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)]
    slots = np.concatenate([table[r, p // BS].astype(np.int64) * BS + p % BS
                            for r, p in enumerate(new_pos)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        seq_lens_cpu=seq_lens.astype(np.int32), block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots), num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=BS)
    return common, table


def _context_slots(table, r, n):
    p = np.arange(n)
    return torch.from_numpy(table[r, p // BS].astype(np.int64) * BS + p % BS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *C8])
def test_indexer_topk_kernel_matches_torch_reference(dtype):
    seq_lens = [3, TOPK, TOPK + 1, 40, 130]
    common, table = _step(seq_lens, [1] * len(seq_lens), seed=1)
    gen = torch.Generator().manual_seed(2)
    cache = allocate_indexer_cache(NUM_BLOCKS, BS, D, dtype, torch.device("cpu"))
    for r, s in enumerate(seq_lens):
        write_indexer_keys(cache, torch.randn(s, D, generator=gen), _context_slots(table, r, s))
    q = torch.randn(len(seq_lens), HI, D, generator=gen)
    w = torch.rand(len(seq_lens), HI, generator=gen) * HI ** -0.5
    rows = np.arange(len(seq_lens), dtype=np.int32)
    got = dsa_indexer_topk(q, w, cache, common.block_table, common.seq_lens_cpu, rows,
                           rows.astype(np.int64), TOPK, D ** -0.5)
    assert got.shape == (len(seq_lens), TOPK) and got.dtype == torch.int64
    for r, s in enumerate(seq_lens):
        keys = read_indexer_keys(cache, _context_slots(table, r, s))
        scores = indexer_scores(q[None, r:r + 1], w[None, r:r + 1], keys[None], D ** -0.5)
        want = select_topk(scores, torch.ones_like(scores, dtype=torch.bool), TOPK)[0, 0]
        mine = got[r][got[r] >= 0]
        if s <= TOPK:                                   # everything, nothing scored
            assert mine.tolist() == list(range(s)) and (got[r, s:] == -1).all()
            continue
        assert len(mine) == TOPK and (mine.diff() > 0).all()
        torch.testing.assert_close(scores[0, 0, mine].sort().values,
                                   scores[0, 0, want].sort().values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_kernel_matches_torch_reference(dtype):
    seq_lens = [5, 40, 130]
    common, table = _step(seq_lens, [1, 1, 1], seed=3)
    gen = torch.Generator().manual_seed(4)
    cache = torch.zeros(1, NUM_BLOCKS, BS, 1, L + DR, dtype=dtype)
    latents = [torch.randn(s, L + DR, generator=gen).to(dtype) for s in seq_lens]
    for r, s in enumerate(seq_lens):
        write_cache_rows(cache, 0, latents[r][:, None], _context_slots(table, r, s))
    positions = torch.full((3, TOPK), -1, dtype=torch.int64)
    positions[0, :5] = torch.arange(5)
    for r in (1, 2):
        positions[r] = torch.randperm(seq_lens[r], generator=gen)[:TOPK]
    q = torch.randn(3, H, L + DR, generator=gen)
    rows = np.arange(3, dtype=np.int32)
    got = dsa_sparse_mla_decode(q, cache, common.block_table, common.seq_lens_cpu, rows,
                                positions, L, 0.3)
    # The reference's absorbed form with W_UK = I and W_UV = I gives the latent output.
    eye = torch.eye(L)[None].expand(H, L, L)
    w_kv_b = torch.cat((eye, eye), dim=1)                   # [H, dn + dv, L] with dn = dv = L
    selected = torch.stack([latents[r][positions[r].clamp(min=0)] for r in range(3)]).float()
    want = sparse_mla_absorbed(q[..., :L], q[..., L:], selected, positions >= 0, w_kv_b, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="past its row's context"):
        dsa_sparse_mla_decode(q, cache, common.block_table, common.seq_lens_cpu, rows,
                              positions.clamp(min=0) + 130, L, 0.3)


@pytest.mark.parametrize("latent_dtype,indexer_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.int8),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.int8, torch.int8)])
def test_cpu_backend_equals_torch_backend_on_a_mixed_step(latent_dtype, indexer_dtype,
                                                          monkeypatch):
    """Decode rows (contexts below, at and above index_topk) and two prefill chunks (their
    tokens kernel rows too, 4 per kernel call) in the kernels: the same output as the torch
    backend, and the same caches."""
    monkeypatch.setattr(dsa_cpu, "_PREFILL_ROWS", 4)
    seq_lens, q_lens = [3, TOPK, 50, 131, 20, 37], [1, 1, 1, 1, 6, 11]
    common, table = _step(seq_lens, q_lens, seed=5)
    gen = torch.Generator().manual_seed(6)
    n = common.num_actual_tokens
    act = torch.float32 if latent_dtype == torch.int8 else latent_dtype
    q_nope = torch.randn(n, H, DN, generator=gen).to(act)
    q_pe = torch.randn(n, H, DR, generator=gen).to(act)
    latent = torch.randn(n, L + DR, generator=gen).to(act)
    w_kv_b = (torch.randn(H, 2 * DN, L, generator=gen) * L ** -0.5).to(act)
    index_q = torch.randn(n, HI, D, generator=gen)
    index_k = torch.randn(n, D, generator=gen)
    weights = torch.rand(n, HI, generator=gen) * HI ** -0.5
    outs, caches = [], []
    used = torch.cat([_context_slots(table, r, s) for r, s in enumerate(seq_lens)])
    for backend in (DSATorchBackend, DSACpuBackend):
        if latent_dtype == torch.int8:
            kv = allocate_kv_cache(NUM_BLOCKS, BS, 1, L + DR, torch.int8, torch.device("cpu"),
                                   num_kv=1)
        else:
            kv = torch.zeros(1, NUM_BLOCKS, BS, 1, L + DR, dtype=latent_dtype)
        icache = allocate_indexer_cache(NUM_BLOCKS, BS, D, indexer_dtype, torch.device("cpu"))
        ctx_gen = torch.Generator().manual_seed(8)
        for r, (s, ql) in enumerate(zip(seq_lens, q_lens)):   # the cached context
            slots = _context_slots(table, r, s - ql)
            write_cache_rows(kv, 0, torch.randn(s - ql, 1, L + DR, generator=ctx_gen).to(act),
                             slots)
            write_indexer_keys(icache, torch.randn(s - ql, D, generator=ctx_gen), slots)
        indexer = IndexerInputs(index_q, index_k, weights, icache, D ** -0.5, TOPK)
        outs.append(backend.forward(q_nope, q_pe, latent, kv, backend.build_metadata(common),
                                    w_kv_b, 0.25, indexer))
        caches.append([c.view(torch.uint8).reshape(-1, c.shape[-1] * c.element_size())[used]
                       for c in (kv, icache)])
    tol = 1e-5 if act == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    assert all(torch.equal(a, b) for a, b in zip(*caches))
