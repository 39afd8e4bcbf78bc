"""The query-tiled path of the CPU paged attention kernel (a tile of a request's query tokens per
work item; register-blocked tiles for long query runs) against the per-token path (query_tile=1)
and dense attention, on random mixed batches: decodes and multi-token chunks over cached contexts, tiles that do not divide the query
lengths, MHA / GQA / MQA, block sizes, sliding windows, soft-capping, every cache dtype,
bidirectional image spans (`attend_until`, Gemma 3), and the portable (no AVX2) build."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kv_cache_layout import allocate_kv_cache, dequantize_kv, write_kv_cache
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.kernel_builds import BUILD_PARAMS, kernel_build
from pagedllm.native.kernels.attention_ops import paged_attention
from pagedllm.native.kernels.attention_ops import paged_attention as _paged_attention

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn]
# attention_query_tiles.h's kGemmMinQueryLen and attention_kernel.h's kSplitLen.
GEMM_MIN_QUERY_LEN = 16
SPLIT_LEN = 256


def _dense(q, k, v, scale, causal, window, soft_cap, horizon=None):
    """q [Q, H, D] at the end of k/v [S, KVH, D]; HF's masks (causal, key > query - window);
    `horizon` [Q] (causal): each query's last visible key position in place of its own."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    k_pos = torch.arange(k.shape[0])[None, :]
    q_pos = (k.shape[0] - q.shape[0] + torch.arange(q.shape[0]))[:, None]
    last = q_pos if horizon is None else torch.as_tensor(horizon)[:, None]
    mask = k_pos <= last if causal else torch.ones_like(k_pos <= q_pos)
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _random_step(shape, cache_dtype, q_lens, ctx, seed):
    """A random cache holding every request's K/V (through write_kv_cache, so quantized caches
    hold their rounded values) and the step's queries."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    H, KVH, D, bs = shape
    q_lens, ctx = np.asarray(q_lens), np.asarray(ctx)
    seq_lens = (ctx + q_lens).astype(np.int32)
    blocks = [-(-int(s) // bs) for s in seq_lens]
    cache = allocate_kv_cache(sum(blocks) + 3, bs, KVH, D, cache_dtype, torch.device("cpu"))
    perm = rng.permutation(np.arange(1, sum(blocks) + 3))
    table = np.zeros((len(q_lens), max(blocks) + 1), dtype=np.int32)
    slots, used = [], 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(seq_lens[r])
        slots.append(table[r, pos // bs].astype(np.int64) * bs + pos % bs)
    slots = torch.from_numpy(np.concatenate(slots))
    k = torch.randn(len(slots), KVH, D, generator=gen)
    v = torch.randn(len(slots), KVH, D, generator=gen)
    write_kv_cache(cache, k, v, slots)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = torch.randn(int(qsl[-1]), H, D, generator=gen)
    return query, cache, torch.from_numpy(table), qsl, seq_lens, slots


def _attend_until(qsl, seq_lens, spans) -> torch.Tensor:
    """[num_tokens] int64 as the runner makes it: each token's position, the span's last one
    for the tokens of an image span (request, first query index, length)."""
    q_lens = np.diff(qsl)
    until = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens.astype(np.int64),
                                                                 q_lens)])
    for r, first, length in spans:
        start = int(qsl[r]) + first
        until[start:start + length] = until[start + length - 1]
    return torch.from_numpy(until)


def _check(lib, shape, cache_dtype, q_lens, ctx, seed, tiles=(2, 5, 16), causal=True,
           window=None, soft_cap=None, rows=None, image_spans=None):
    query, cache, table, qsl, seq_lens, slots = _random_step(shape, cache_dtype, q_lens, ctx,
                                                             seed)
    rows = np.arange(len(q_lens), dtype=np.int32) if rows is None else np.asarray(rows,
                                                                                 np.int32)
    scale = shape[2] ** -0.5
    args = (query, cache, table, qsl, seq_lens, rows, scale, causal, window, soft_cap)
    until = None if image_spans is None else _attend_until(qsl, seq_lens, image_spans)

    def paged_attention(*args, **kwargs):
        return _paged_attention(*args, attend_until=until, **kwargs)

    per_token = paged_attention(*args, query_tile=1, lib=lib)
    # Requests of at least GEMM_MIN_QUERY_LEN query tokens take the register-blocked tiles
    # (AVX2 builds, head sizes % 32 == 0), which sum in another order: close to the per-token
    # path. Shorter runs walk the per-token path's pieces in the same order, the same floats,
    # while a token's context is not split (at most SPLIT_LEN keys); the per-token path splits
    # a longer one at fixed positions, the tiles do not (close). Decodes take the per-token
    # items either way: the same floats at any context.
    q_lens = np.asarray(q_lens)
    req = np.searchsorted(qsl[1:], np.arange(len(query)), side="right")
    gemm = (q_lens >= GEMM_MIN_QUERY_LEN)[req]
    token_ctx = (seq_lens[req] - q_lens[req] + np.arange(len(query)) - qsl[req] + 1 if causal
                 else seq_lens[req])
    if until is not None and causal:
        token_ctx = until.numpy() + 1
    exact = ~gemm & ((token_ctx <= SPLIT_LEN) | (q_lens[req] == 1))
    tiled_outputs = [paged_attention(*args, query_tile=tile, lib=lib) for tile in tiles]
    tiled_outputs.append(paged_attention(*args, lib=lib))   # the default tile
    for tile, tiled in zip((*tiles, "default"), tiled_outputs):
        assert torch.equal(tiled[exact], per_token[exact]), tile
        torch.testing.assert_close(tiled[~exact], per_token[~exact], atol=1e-6, rtol=1e-5)
    k_all = dequantize_kv(cache, 0, slots, torch.float32)
    v_all = dequantize_kv(cache, 1, slots, torch.float32)
    seq_start = np.concatenate([[0], np.cumsum(seq_lens)])
    for r in range(len(q_lens)):
        for out in (per_token, tiled_outputs[-1]):
            got = out[qsl[r]:qsl[r + 1]]
            if r not in rows:
                assert not got.any()
                continue
            kv = slice(seq_start[r], seq_start[r + 1])
            want = _dense(query[qsl[r]:qsl[r + 1]], k_all[kv], v_all[kv], scale, causal,
                          window, soft_cap, None if until is None else until[qsl[r]:qsl[r + 1]])
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# (heads, kv heads, head size, block size)
SHAPES = [(4, 2, 8, 4), (8, 8, 64, 16), (8, 1, 16, 8), (6, 3, 40, 8), (4, 2, 128, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_tiles_equal_per_token_and_dense(shape, cache_dtype):
    # decodes, chunks over cached contexts, a fresh prefill, a chunk shorter than every tile
    _check(cpu_kernels(), shape, cache_dtype, q_lens=[1, 37, 3, 1, 21, 16],
           ctx=[30, 11, 0, 5, 40, 0], seed=1)


@pytest.mark.parametrize("window,soft_cap", [(1, None), (4, None), (19, None), (None, 2.0),
                                             (7, 3.0), (500, None)])
@pytest.mark.parametrize("shape", [(4, 2, 16, 4), (6, 3, 32, 16)], ids=str)
def test_tiles_with_window_and_soft_cap(shape, window, soft_cap):
    _check(cpu_kernels(), shape, torch.bfloat16, q_lens=[33, 1, 12, 9], ctx=[25, 60, 0, 3],
           seed=2, window=window, soft_cap=soft_cap)


def test_tiles_non_causal_and_row_subset():
    """Non-causal rows attend to their whole sequence; rows outside `rows` stay untouched."""
    _check(cpu_kernels(), (6, 2, 16, 8), torch.float32, q_lens=[11, 7, 1, 20],
           ctx=[9, 0, 4, 13], seed=3, causal=False, window=6)
    _check(cpu_kernels(), (6, 2, 16, 8), torch.float32, q_lens=[11, 7, 1, 20],
           ctx=[9, 0, 4, 13], seed=4, rows=[0, 3])


@pytest.mark.parametrize("build", BUILD_PARAMS[:2])
def test_register_blocked_tiles_of_each_build(build):
    """Runs of 16+ query tokens with head sizes % 32 == 0 take the register-blocked tiles: the
    row-lane tiles (attention_row_lanes.h) in AVX-512 builds, attend_tile_gemm in AVX2 ones;
    causal and not, GQA, every cache dtype, contexts over several 64-key chunks, image spans
    (attend_until) across the chunks."""
    lib = kernel_build(build)
    for i, cache_dtype in enumerate(CACHE_DTYPES):
        _check(lib, (8, 2, 32, 16), cache_dtype, q_lens=[70, 1, 16, 33], ctx=[150, 20, 0, 5],
               seed=10 + i, tiles=(16,), causal=bool(i % 2),
               image_spans=[(0, 10, 50), (2, 0, 16), (3, 4, 20)] if i % 2 else None)


@pytest.mark.parametrize("seed", range(3))
def test_tiles_random_batches(seed):
    rng = np.random.default_rng(seed)
    heads, kv_heads = [(4, 4), (8, 2), (6, 1)][seed]
    shape = (heads, kv_heads, int(rng.choice([16, 32, 48])), int(rng.choice([4, 8, 16])))
    n = int(rng.integers(2, 7))
    q_lens = np.where(rng.random(n) < 0.4, 1, rng.integers(2, 45, n))
    ctx = rng.integers(0, 70, n) * (rng.random(n) < 0.8)
    _check(cpu_kernels(), shape, CACHE_DTYPES[seed % 4], q_lens, ctx, seed,
           tiles=(int(rng.integers(2, 9)), 16), window=[None, 13, None][seed],
           soft_cap=[None, None, 4.0][seed])


def test_query_tile_must_be_positive():
    query, cache, table, qsl, seq_lens, _ = _random_step((2, 1, 8, 4), torch.float32, [3], [2],
                                                         0)
    with pytest.raises(ValueError, match="query_tile"):
        paged_attention(query, cache, table, qsl, seq_lens, np.zeros(1, np.int32), 0.3,
                        query_tile=0)


@pytest.mark.slow   # builds the portable kernel library (a minute on a loaded 2-core machine)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_portable_build_tiles(cache_dtype):
    lib = kernel_build("portable")
    _check(lib, (6, 3, 32, 8), cache_dtype, q_lens=[1, 29, 17, 4], ctx=[20, 7, 0, 33], seed=5,
           window=9, soft_cap=5.0)
    _check(lib, (4, 1, 16, 4), cache_dtype, q_lens=[18, 1, 40], ctx=[3, 9, 21], seed=6)
    _check(lib, (4, 2, 32, 16), cache_dtype, seed=11, window=8, image_spans=IMAGE_SPANS,
           **IMAGE_STEP)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("window,soft_cap", [(None, None), (300, None), (None, 3.0)])
def test_split_kv_decodes_of_long_contexts(cache_dtype, window, soft_cap):
    """Decode rows whose context passes the split length (256 positions) run as pieces merged
    afterwards (flash-decoding): against dense attention, next to short decodes and multi-token
    chunks (which are not split), with GQA; a window leaves the early pieces empty."""
    _check(cpu_kernels(), (8, 2, 32, 16), cache_dtype, q_lens=[1, 1, 9, 1, 1],
           ctx=[700, 40, 300, 1030, 256], seed=7, tiles=(4,), window=window,
           soft_cap=soft_cap)


def test_split_decode_rows_do_not_depend_on_the_batch():
    """A long decode row gives the same floats alone and beside other requests (its split
    depends on its own context only)."""
    shape = (6, 3, 16, 8)
    query, cache, table, qsl, seq_lens, _ = _random_step(shape, torch.bfloat16, [1, 5, 1],
                                                         [900, 20, 3], 8)
    scale = shape[2] ** -0.5
    together = paged_attention(query, cache, table, qsl, seq_lens,
                               np.arange(3, dtype=np.int32), scale)
    alone = paged_attention(query, cache, table, qsl, seq_lens, np.zeros(1, np.int32), scale)
    assert torch.equal(together[0], alone[0]) and not torch.equal(together[0], together[1])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 100])
def test_per_token_path_depends_on_each_tokens_context_alone(cache_dtype, window):
    # The batch-invariant mode's attention (query_tile=1): a chunk of 40 query tokens over a
    # context that crosses the 256-key split gives, token for token, the floats of each token
    # computed alone as a decode, and of the chunk batched with another request.
    shape = (8, 4, 32, 16)
    query, cache, table, qsl, seq_lens, _ = _random_step(shape, cache_dtype, [40, 9],
                                                         [270, 500], seed=3)
    scale = shape[2] ** -0.5
    whole = paged_attention(query, cache, table, qsl, seq_lens, np.arange(2, dtype=np.int32),
                            scale, True, window, None, query_tile=1)
    alone = paged_attention(query[:40], cache, table[:1], qsl[:2], seq_lens[:1],
                            np.zeros(1, np.int32), scale, True, window, None, query_tile=1)
    assert torch.equal(whole[:40], alone)
    for i in range(0, 40, 7):   # token i of the chunk as a decode: its context is 270 + i + 1
        decode = paged_attention(query[i:i + 1], cache, table[:1],
                                 np.array([0, 1], np.int32),
                                 np.array([271 + i], np.int32), np.zeros(1, np.int32), scale,
                                 True, window, None, query_tile=1)
        assert torch.equal(decode[0], whole[i]), i


# (request, first query index, tokens): image spans over q_lens [37, 1, 21, 70, 16] after
# contexts [11, 30, 0, 150, 0]: across 16-token tiles and 64-token GEMM tiles, at a chunk's
# start after a cached context, up to a request's last query, two in one request, beside a
# decode; the 70-token run's contexts cross the per-token path's 256-key split.
IMAGE_STEP = dict(q_lens=[37, 1, 21, 70, 16], ctx=[11, 30, 0, 150, 0])
IMAGE_SPANS = [(0, 0, 9), (0, 12, 25), (2, 3, 14), (3, 5, 60), (4, 15, 1)]


@pytest.mark.parametrize("shape,window,soft_cap,cache_dtype", [
    ((4, 2, 32, 16), None, None, torch.float32), ((8, 1, 16, 8), 8, None, torch.bfloat16),
    ((6, 3, 64, 16), 20, 4.0, torch.int8), ((4, 4, 40, 4), None, None, torch.float8_e4m3fn)],
    ids=str)
def test_attend_until_equals_dense(shape, window, soft_cap, cache_dtype):
    """Bidirectional image spans: every path (per-token items, per-row and register-blocked
    tiles) against dense attention with HF's "causal OR same image" mask, the window counted
    from the query's own position."""
    _check(cpu_kernels(), shape, cache_dtype, seed=11, window=window, soft_cap=soft_cap,
           image_spans=IMAGE_SPANS, **IMAGE_STEP)


def test_attend_until_changes_outputs_only_where_it_differs():
    """The spans' tokens (and only they, in a causal step without a window) differ from causal
    attention; a bad attend_until is refused."""
    shape = (4, 2, 32, 16)
    query, cache, table, qsl, seq_lens, _ = _random_step(shape, torch.float32, seed=12,
                                                         **IMAGE_STEP)
    rows = np.arange(len(seq_lens), dtype=np.int32)
    args = (query, cache, table, qsl, seq_lens, rows, shape[2] ** -0.5)
    until = _attend_until(qsl, seq_lens, IMAGE_SPANS)
    causal = paged_attention(*args)
    spans = paged_attention(*args, attend_until=until)
    positions = _attend_until(qsl, seq_lens, [])
    assert torch.equal(paged_attention(*args, attend_until=positions), causal)
    differs = (spans - causal).abs().amax(dim=(1, 2)) > 1e-3
    assert torch.equal(differs, until > positions)
    for bad in (until[:-1], until.to(torch.int32), until.repeat_interleave(2)[::2]):
        with pytest.raises(ValueError, match="attend_until must be"):
            paged_attention(*args, attend_until=bad)


@pytest.mark.parametrize("shape", [(8, 2, 64, 16), (6, 3, 40, 8), (4, 1, 576, 16),
                                   (4, 1, 144, 16)], ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_heads_sharing_a_kv_head_give_each_heads_floats_alone(shape, cache_dtype):
    # Decodes (and a split context): the query heads of one KV head, computed together (two
    # at a time on AVX-512 builds, their values up to eight at a time), give each head exactly
    # the floats it gets computed alone against its KV head. (Eight or more heads per KV head
    # take the two-pass decode on AVX-512 builds, another order of sums: tested below.)
    H, KVH, D, bs = shape
    query, cache, table, qsl, seq_lens, _ = _random_step(shape, cache_dtype, [1, 1, 1, 1],
                                                         [5, 40, 200, 300], seed=11)
    rows = np.arange(4, dtype=np.int32)
    scale = D ** -0.5
    together = paged_attention(query, cache, table, qsl, seq_lens, rows, scale)
    rep = H // KVH
    for h in range(H):
        kv = h // rep
        one_head = cache[:, :, :, kv:kv + 1].contiguous()
        alone = paged_attention(query[:, h:h + 1].contiguous(), one_head, table, qsl,
                                seq_lens, rows, scale)
        assert torch.equal(together[:, h], alone[:, 0]), h


@pytest.mark.parametrize("shape", [(8, 1, 144, 16), (16, 1, 144, 16), (16, 2, 64, 16),
                                   (8, 1, 48, 8), (8, 1, 40, 8)], ids=str)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 300])
def test_decodes_with_eight_heads_per_kv_head(shape, cache_dtype, window):
    # Eight query heads per KV head (MLA's absorbed decode: one latent for 8-128 heads; GQA with
    # rep % 8 == 0): on AVX-512 builds with head_size % 16 == 0 and float32 / bfloat16 caches
    # the decodes run in two passes over each piece of <= 256 positions (all scores, then one
    # softmax and the value sums); against dense float64 attention, short contexts, one block,
    # an offset start (window), split contexts of several pieces, and the other paths (head
    # size 40, 8-bit caches) beside them.
    _check(cpu_kernels(), shape, cache_dtype, q_lens=[1, 1, 1, 1, 1, 1],
           ctx=[0, 7, 40, 200, 700, 1030], seed=5, tiles=(4,), window=window)
