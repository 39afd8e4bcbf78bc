"""Quantized KV caches (int8 per token and head, fp8 e4m3 per tensor): the layout with its scales,
quantization error bounds, and both CPU backends on random mixed steps against dense attention
over the dequantized K/V (tight) and over the original K/V (within the quantization error)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.kv_cache_layout import (allocate_kv_cache, dequantize_kv,
                                      kv_cache_block_bytes, kv_cache_scales,
                                      quantize_fp8, quantize_int8,
                                      resolve_kv_cache_dtype, write_kv_cache)
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.backends.triton_paged import TritonPagedBackend
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.config import CacheConfig
from tests.attention.test_backends import _dense

BACKENDS = [TorchSDPABackend,
            pytest.param(CpuPagedBackend, marks=pytest.mark.skipif(
                not CpuPagedBackend.is_available(), reason="CPU kernels did not build"))]
QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


def test_resolve_kv_cache_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("int8", torch.float32) == torch.int8
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int4", torch.float32)


def test_cache_config_validates_kv_cache_dtype():
    assert CacheConfig(cache_dtype="fp8").cache_dtype == "fp8_e4m3"
    assert CacheConfig(cache_dtype="int8").cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(cache_dtype="float16")


def test_layout_and_block_bytes():
    cache = allocate_kv_cache(5, 4, 3, 8, torch.int8, torch.device("cpu"))
    assert cache.shape == (2, 5, 4, 3, 8) and cache.dtype == torch.int8
    scales = kv_cache_scales(cache)
    assert scales.shape == (2, 5, 4, 3) and scales.dtype == torch.float32
    assert cache.untyped_storage().nbytes() == 5 * kv_cache_block_bytes(4, 3, 8, torch.int8)
    # scales are a view of the allocation: a write is seen by the next lookup
    scales[1, 2, 3, 0] = 7.0
    assert kv_cache_scales(cache)[1, 2, 3, 0] == 7.0
    assert kv_cache_block_bytes(4, 3, 8, torch.int8) == 2 * 4 * 3 * (8 + 4)
    assert kv_cache_block_bytes(4, 3, 8, torch.float8_e4m3fn) == 2 * 4 * 3 * 8
    assert kv_cache_block_bytes(4, 3, 8, torch.bfloat16) == 2 * 4 * 3 * 8 * 2
    fp8 = allocate_kv_cache(5, 4, 3, 8, torch.float8_e4m3fn, torch.device("cpu"))
    assert kv_cache_scales(fp8).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="no scales"):
        kv_cache_scales(torch.zeros(2, 5, 4, 3, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="no scales"):
        kv_cache_scales(cache[:, 1:])


def test_quantization_error_bounds():
    x = torch.randn(50, 4, 32) * torch.rand(50, 4, 1) * 10
    x[3, 1] = 0.0
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (q.float() * s[..., None] - x).abs()
    assert bool((err <= s[..., None] / 2 + 1e-6).all())
    assert s[3, 1] == 0 and bool((q[3, 1] == 0).all())
    y = torch.tensor([0.3, -2.0, 100.0, 447.0, 1000.0, -5000.0])
    f = quantize_fp8(y, 1.0).float()
    assert f[-2] == 448.0 and f[-1] == -448.0         # clamped to the fp8 range
    torch.testing.assert_close(f[:4], y[:4], rtol=2 ** -4, atol=0)


def _random_step(shape, cache_dtype, num_reqs, seed, max_query_len=12, magnitude=1.0):
    """A random mixed step over a quantized cache: returns (metadata, q, new k, new v, cache,
    per-request (q, full k, full v))."""
    rng = np.random.default_rng(seed)
    H, KVH, D, bs = shape
    num_blocks = 80
    ctx = rng.integers(0, 40, num_reqs) * (rng.random(num_reqs) < 0.7)
    q_lens = np.where(rng.random(num_reqs) < 0.5, 1, rng.integers(1, max_query_len, num_reqs))
    seq_lens = ctx + q_lens
    cache = allocate_kv_cache(num_blocks, bs, KVH, D, cache_dtype, torch.device("cpu"))
    perm = rng.permutation(np.arange(1, num_blocks))
    block_table = np.zeros((num_reqs, int(-(-seq_lens.max() // bs))), dtype=np.int32)
    reqs, used = [], 0
    gen = torch.Generator().manual_seed(seed)
    for r in range(num_reqs):
        nb = -(-seq_lens[r] // bs)
        block_table[r, :nb] = perm[used:used + nb]
        used += nb
        k = torch.randn(seq_lens[r], KVH, D, generator=gen) * magnitude
        v = torch.randn(seq_lens[r], KVH, D, generator=gen) * magnitude
        q = torch.randn(q_lens[r], H, D, generator=gen)
        pos = np.arange(ctx[r])
        slots = torch.from_numpy(block_table[r, pos // bs].astype(np.int64) * bs + pos % bs)
        write_kv_cache(cache, k[:ctx[r]], v[:ctx[r]], slots)
        reqs.append((q, k, v, block_table[r]))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    slots = np.concatenate([block_table[r, np.arange(ctx[r], seq_lens[r]) // bs].astype(np.int64)
                            * bs + np.arange(ctx[r], seq_lens[r]) % bs for r in range(num_reqs)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        seq_lens_cpu=seq_lens.astype(np.int32), block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots), num_reqs=num_reqs, num_actual_tokens=int(qsl[-1]),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()), block_size=bs)
    new_k = torch.cat([k[c:] for (_, k, _, _), c in zip(reqs, ctx)])
    new_v = torch.cat([v[c:] for (_, _, v, _), c in zip(reqs, ctx)])
    return common, torch.cat([q for q, *_ in reqs]), new_k, new_v, cache, reqs


def _cached_kv(cache, table, seq_len, bs):
    pos = np.arange(seq_len)
    slots = torch.from_numpy(table[pos // bs].astype(np.int64) * bs + pos % bs)
    return (dequantize_kv(cache, 0, slots, torch.float32),
            dequantize_kv(cache, 1, slots, torch.float32))


# (heads, kv heads, head size, block size)
SHAPES = [(4, 2, 16, 4), (6, 6, 64, 16), (8, 1, 40, 8), (4, 2, 128, 16)]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 3.0)])
def test_quantized_cache_matches_dense(backend, cache_dtype, shape, window, soft_cap):
    common, q, k, v, cache, reqs = _random_step(shape, cache_dtype, 6, seed=shape[2],
                                                max_query_len=20)
    bs, scale = shape[3], shape[2] ** -0.5
    out = backend.forward(q, k, v, cache, backend.build_metadata(common), scale,
                          sliding_window=window, logits_soft_cap=soft_cap)
    seq_lens = common.seq_lens_cpu
    # the cache now holds every token, each request's queries see exactly those values
    want_dq, want_fp = [], []
    for r, (qr, kr, vr, table) in enumerate(reqs):
        kd, vd = _cached_kv(cache, table, int(seq_lens[r]), bs)
        want_dq.append(_dense(qr, kd, vd, scale, window, soft_cap))
        want_fp.append(_dense(qr, kr, vr, scale, window, soft_cap))
    torch.testing.assert_close(out, torch.cat(want_dq), atol=2e-5, rtol=2e-5)
    # against the unquantized K/V: within the quantization error
    tol = 3e-2 if cache_dtype == torch.int8 else 2.5e-1
    torch.testing.assert_close(out, torch.cat(want_fp), atol=tol, rtol=0)


@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES, ids=str)
def test_new_rows_written_quantized(cache_dtype):
    common, q, k, v, cache, _ = _random_step((4, 2, 16, 4), cache_dtype, 5, seed=3)
    TorchSDPABackend.forward(q, k, v, cache, TorchSDPABackend.build_metadata(common), 0.25)
    slots = common.slot_mapping
    got_k = dequantize_kv(cache, 0, slots, torch.float32)
    got_v = dequantize_kv(cache, 1, slots, torch.float32)
    tol = dict(atol=2e-2, rtol=0) if cache_dtype == torch.int8 else dict(atol=2e-3, rtol=2 ** -4)
    torch.testing.assert_close(got_k, k, **tol)
    torch.testing.assert_close(got_v, v, **tol)
    assert bool((cache[:, 0] == 0).all().item()) if cache_dtype == torch.int8 else True


@pytest.mark.skipif(not CpuPagedBackend.is_available(), reason="CPU kernels did not build")
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES, ids=str)
def test_fp8_calibrated_scales_and_backends_agree(cache_dtype):
    """Large K/V with a stored fp8 scale > 1 (values beyond 448 survive); both backends read the
    same cache the same way."""
    common, q, k, v, cache, _ = _random_step((6, 3, 32, 8), cache_dtype, 6, seed=7,
                                             magnitude=1.0)
    if cache_dtype == torch.float8_e4m3fn:
        kv_cache_scales(cache).fill_(4.0)
        k, v = k * 600, v * 600
    twin = allocate_kv_cache(*cache.shape[1:], cache_dtype, torch.device("cpu"))
    twin.untyped_storage().copy_(cache.untyped_storage())
    a = CpuPagedBackend.forward(q, k, v, cache, CpuPagedBackend.build_metadata(common), 0.2)
    b = TorchSDPABackend.forward(q, k, v, twin, TorchSDPABackend.build_metadata(common), 0.2)
    torch.testing.assert_close(a, b, atol=1e-3 * float(v.abs().max()), rtol=1e-4)
    if cache_dtype == torch.float8_e4m3fn:
        got = dequantize_kv(cache, 1, common.slot_mapping, torch.float32)
        torch.testing.assert_close(got, v.clamp(-448 * 4, 448 * 4), rtol=2 ** -4,
                                   atol=4 * 2 ** -9)
        assert float(v.abs().max()) > 448   # beyond fp8's range at scale 1


@pytest.mark.slow   # builds the portable kernel library (a minute on a loaded 2-core machine)
@pytest.mark.skipif(not CpuPagedBackend.is_available(), reason="CPU kernels did not build")
@pytest.mark.parametrize("cache_dtype", QUANT_DTYPES, ids=str)
def test_portable_kernel_reads_quantized_caches(cache_dtype):
    """The kernels' portable path (built without AVX2/FMA, what a CPU without AVX2 runs) on a
    quantized cache, called directly, against dense attention over the dequantized K/V."""
    from pagedllm.native.kernels.attention_ops import paged_attention

    from tests.fixtures.kernel_builds import kernel_build

    lib = kernel_build("portable")
    shape = (6, 3, 32, 8)
    common, q, k, v, cache, reqs = _random_step(shape, cache_dtype, 5, seed=11)
    write_kv_cache(cache, k, v, common.slot_mapping)
    H, KVH, D, bs = shape
    qsl = np.ascontiguousarray(common.query_start_loc_cpu, dtype=np.int32)
    seq_lens = np.ascontiguousarray(common.seq_lens_cpu, dtype=np.int32)
    rows = np.arange(common.num_reqs, dtype=np.int32)
    out = paged_attention(q, cache, common.block_table, qsl, seq_lens, rows, D ** -0.5, lib=lib)
    want = []
    for r, (qr, _, _, table) in enumerate(reqs):
        kd, vd = _cached_kv(cache, table, int(seq_lens[r]), bs)
        want.append(_dense(qr, kd, vd, D ** -0.5))
    torch.testing.assert_close(out, torch.cat(want), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not TritonPagedBackend.is_available(), reason="triton is not installed")
def test_triton_refuses_quantized_caches():
    common, q, k, v, cache, _ = _random_step((4, 2, 16, 4), torch.int8, 2, seed=1)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        TritonPagedBackend.forward(q, k, v, cache, TritonPagedBackend.build_metadata(common), 0.25)
