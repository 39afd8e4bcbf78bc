"""The CPU MLA backend (`mla_cpu_paged`: decodes and short prefill chunks absorbed in the native
paged-attention kernel, longer chunks expanded, with the attention in the kernel or in torch)
against float64 attention computed
per head from the cache (the oracle), and against the torch reference `mla_torch`: several
requests in one step (a prefill without a prefix, chunks over cached prefixes longer than a
tile and than the kernel's context split, a decode, a short chunk), block tables that are
random permutations of the blocks, float32 / bfloat16 / int8 / fp8 latent caches, latent sizes
that take the kernel's register-blocked tiles (L + dr % 32 == 0) and that do not.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedllm.attention.backends.mla_cpu import ABSORBED_COST_FACTOR, MLACpuBackend, _query_tile
from pagedllm.attention.backends.mla_torch import MLATorchBackend, prefers_absorbed
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.kv_cache_layout import (KV_CACHE_DTYPES, allocate_kv_cache, dequantize_kv,
                                      kv_cache_scales, write_cache_rows)
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.attention_ops import mla_expanded_prefill, mla_expanded_prefill_supported

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels unavailable")

DR, DN, DV, BLOCK = 8, 16, 24, 16
# Cached prefix and new query tokens per request: a fresh prefill, a chunk over a long prefix
# (several kernel tiles and context splits), a decode, a short chunk, a decode of length 1.
CTX, QLEN = [0, 300, 40, 7, 0], [19, 37, 1, 5, 1]


def _step(kv_lora_rank: int, num_heads: int, cache_dtype: str, dtype: torch.dtype, seed=0,
          ctx=CTX, q_lens=QLEN):
    """(q_nope, q_pe, latent, cache, common, w_kv_b): a random step whose cached prefixes are
    already in the cache; the new tokens' latents are written by the backend."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ctx, q_lens = np.array(ctx), np.array(q_lens)
    seq_lens = ctx + q_lens
    blocks = -(-seq_lens // BLOCK)
    num_blocks = int(blocks.sum()) + 2
    perm = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((len(ctx), int(blocks.max()) + 1), dtype=np.int32)
    used = 0
    for r, b in enumerate(blocks):
        table[r, :b] = perm[used:used + b]
        used += b
    size = kv_lora_rank + DR
    cache = allocate_kv_cache(num_blocks, BLOCK, 1, size, KV_CACHE_DTYPES.get(cache_dtype, dtype),
                              torch.device("cpu"), num_kv=1)
    if cache_dtype == "fp8_e4m3":
        kv_cache_scales(cache).fill_(0.05)   # not the default 1.0, so that a lost scale shows
    slots = [table[r, np.arange(s) // BLOCK].astype(np.int64) * BLOCK + np.arange(s) % BLOCK
             for r, s in enumerate(seq_lens)]
    old = np.concatenate([s[:c] for s, c in zip(slots, ctx)])
    write_cache_rows(cache, 0, torch.randn(len(old), 1, size, generator=gen).to(dtype),
                     torch.from_numpy(old))
    new = np.concatenate([s[c:] for s, c in zip(slots, ctx)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = len(new)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        seq_lens_cpu=seq_lens.astype(np.int32), block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(np.concatenate([new, [-1]])), num_reqs=len(ctx),
        num_actual_tokens=n, max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=BLOCK, causal=True)
    q_nope = torch.randn(n + 1, num_heads, DN, generator=gen).to(dtype)      # one padded token
    q_pe = torch.randn(n + 1, num_heads, DR, generator=gen).to(dtype)
    latent = torch.randn(n + 1, size, generator=gen).to(dtype)
    w_kv_b = (0.3 * torch.randn(num_heads, DN + DV, kv_lora_rank, generator=gen)).to(dtype)
    return q_nope, q_pe, latent, cache, common, w_kv_b


def assert_expanded_rows_in_torch(q_nope, q_pe, latent, cache, common, w_kv_b):
    """A step forced into the expanded form runs its rows in torch (none in the expanded
    kernel), equal to per-head attention (`_per_head_reference`, float64)."""
    metadata = MLACpuBackend.build_metadata(common, prefill_form="expanded")
    out = MLACpuBackend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b, 0.3)
    (split,) = metadata.splits.values()
    assert not len(split.expanded_rows) and split.expanded_groups
    torch.testing.assert_close(out[:common.num_actual_tokens].double(),
                               _per_head_reference(q_nope, q_pe, cache, common, w_kv_b, 0.3),
                               atol=2e-5, rtol=2e-5)


def _per_head_reference(q_nope, q_pe, cache, common, w_kv_b, scale):
    """Causal per-head attention in float64 with K / V expanded from the dequantized latents:
    [n, H, dv]."""
    kv_lora_rank = w_kv_b.shape[-1]
    w = w_kv_b.double()
    outs = []
    qsl = common.query_start_loc_cpu
    for r in range(common.num_reqs):
        s = int(common.seq_lens_cpu[r])
        pos = np.arange(s)
        slots = common.block_table[r].long()[pos // BLOCK] * BLOCK + torch.from_numpy(pos % BLOCK)
        ctx = dequantize_kv(cache, 0, slots, torch.float64)[:, 0]
        c_kv, k_pe = ctx[:, :kv_lora_rank], ctx[:, kv_lora_rank:]
        k_nope = torch.einsum("sl,hdl->hsd", c_kv, w[:, :DN])
        v = torch.einsum("sl,hdl->hsd", c_kv, w[:, DN:])
        t = slice(int(qsl[r]), int(qsl[r + 1]))
        scores = (torch.einsum("qhd,hsd->hqs", q_nope[t].double(), k_nope)
                  + torch.einsum("qhd,sd->hqs", q_pe[t].double(), k_pe)) * scale
        q_pos = s - (t.stop - t.start) + torch.arange(t.stop - t.start)
        scores = scores.masked_fill(torch.arange(s)[None, None] > q_pos[None, :, None], -1e300)
        outs.append(torch.einsum("hqs,hsd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("cache_dtype,dtype,kv_lora_rank,num_heads", [
    ("auto", torch.float32, 56, 4),        # L + dr = 64: register-blocked tiles for >= 16 tokens
    ("auto", torch.float32, 40, 6),        # L + dr = 48: the per-row tile path throughout
    ("auto", torch.bfloat16, 56, 4),
    ("int8", torch.float32, 56, 4),
    ("fp8_e4m3", torch.float32, 56, 4),
    ("auto", torch.float32, 56, 8),        # 8 heads on one latent: two-pass decodes (AVX-512)
    ("auto", torch.bfloat16, 56, 16),
], ids=str)
def test_absorbed_kernel_matches_per_head_attention(cache_dtype, dtype, kv_lora_rank, num_heads):
    """Every row in the kernel (decodes, short and long chunks, fresh prefills) equals per-head
    attention from the cache; the padded token's output stays zero."""
    q_nope, q_pe, latent, cache, common, w_kv_b = _step(kv_lora_rank, num_heads, cache_dtype,
                                                        dtype)
    scale = (DN + DR) ** -0.5
    metadata = MLACpuBackend.build_metadata(common, prefill_form="absorbed")
    out = MLACpuBackend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b, scale)
    (split,) = metadata.splits.values()
    assert len(split.kernel_rows) == common.num_reqs and not split.expanded_groups
    want = _per_head_reference(q_nope, q_pe, cache, common, w_kv_b, scale)
    n = common.num_actual_tokens
    assert out.dtype == dtype and out.shape == (n + 1, num_heads, DV)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out[:n].double(), want, atol=tol, rtol=tol)
    assert not out[n:].any()


@pytest.mark.parametrize("cache_dtype,dtype,kv_lora_rank,num_heads", [
    ("auto", torch.float32, 56, 4),
    ("auto", torch.float32, 40, 6),
    ("auto", torch.bfloat16, 56, 4),
    ("int8", torch.float32, 56, 4),
    ("fp8_e4m3", torch.float32, 56, 4),
], ids=str)
def test_expanded_kernel_matches_per_head_attention(cache_dtype, dtype, kv_lora_rank, num_heads):
    """Every prefill chunk in the expanded form with the attention in the kernel (the fresh
    prefill, the long chunk over a prefix and the short chunk; decodes absorbed beside them)
    equals per-head attention from the cache, also when the requests are expanded in several
    batches; the padded token's output stays zero."""
    if not mla_expanded_prefill_supported():
        pytest.skip("this build has no expanded MLA kernel")
    q_nope, q_pe, latent, cache, common, w_kv_b = _step(kv_lora_rank, num_heads, cache_dtype,
                                                        dtype)
    scale = (DN + DR) ** -0.5
    want = None
    n = common.num_actual_tokens
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for batch_positions in (8192, 32):
        metadata = MLACpuBackend.build_metadata(common, prefill_form="expanded",
                                                expanded_batch_positions=batch_positions)
        out = MLACpuBackend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b, scale)
        (split,) = metadata.splits.values()
        assert split.expanded_rows.tolist() == [0, 1, 3] and not split.expanded_groups
        assert split.kernel_rows.tolist() == [2, 4]
        if want is None:
            want = _per_head_reference(q_nope, q_pe, cache, common, w_kv_b, scale)
        assert out.dtype == dtype and out.shape == (n + 1, num_heads, DV)
        torch.testing.assert_close(out[:n].double(), want, atol=tol, rtol=tol)
        assert not out[n:].any()


@pytest.mark.parametrize("cache_dtype,dtype", [("auto", torch.float32), ("auto", torch.bfloat16),
                                               ("int8", torch.float32)], ids=str)
def test_expanded_kernel_on_fresh_prefills(cache_dtype, dtype):
    """Fresh prefills only (beside decodes): the kernel reads the step's own latents (model
    dtype caches) or gathers them (int8), equal to per-head attention from the cache; the
    queries come as the model makes them, strided views of one projection's output."""
    if not mla_expanded_prefill_supported():
        pytest.skip("this build has no expanded MLA kernel")
    q_nope, q_pe, latent, cache, common, w_kv_b = _step(56, 4, cache_dtype, dtype, 2,
                                                        ctx=[0, 0, 40, 0], q_lens=[19, 37, 1, 3])
    scale = (DN + DR) ** -0.5
    metadata = MLACpuBackend.build_metadata(common, prefill_form="expanded")
    q_nope_view, q_pe_view = torch.cat((q_nope, q_pe), dim=-1).split([DN, DR], dim=-1)
    out = MLACpuBackend.forward(q_nope_view, q_pe_view, latent, cache, metadata, w_kv_b, scale)
    (split,) = metadata.splits.values()
    assert split.expanded_rows.tolist() == [0, 1, 3] and split.kernel_rows.tolist() == [2]
    n = common.num_actual_tokens
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out[:n].double(),
                               _per_head_reference(q_nope, q_pe, cache, common, w_kv_b, scale),
                               atol=tol, rtol=tol)
    assert not out[n:].any()


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("expanded_in_kernel", [True, False])
def test_split_between_kernel_and_expanded_rows_matches_mla_torch(cache_dtype,
                                                                  expanded_in_kernel):
    """The rule sends the fresh prefill and the long chunk to the expanded form (in the kernel
    or in torch), the short chunk over a prefix and the decodes to the absorbed form in the
    kernel; the result and the cache writes equal mla_torch's, and the batch-invariant mode is
    mla_torch's exactly."""
    if expanded_in_kernel and not mla_expanded_prefill_supported():
        pytest.skip("this build has no expanded MLA kernel")
    q_nope, q_pe, latent, cache, common, w_kv_b = _step(56, 4, cache_dtype, torch.float32, 1)
    scale = 0.3
    copy = allocate_kv_cache(cache.shape[1], BLOCK, 1, cache.shape[-1], cache.dtype,
                             torch.device("cpu"), num_kv=1)
    copy.view(torch.uint8).copy_(cache.view(torch.uint8))
    if cache.element_size() == 1:
        kv_cache_scales(copy).copy_(kv_cache_scales(cache))
    want = MLATorchBackend.forward(q_nope, q_pe, latent, copy,
                                   MLATorchBackend.build_metadata(common), w_kv_b, scale)
    metadata = MLACpuBackend.build_metadata(common, expanded_in_kernel=expanded_in_kernel)
    out = MLACpuBackend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b, scale)
    (split,) = metadata.splits.values()
    assert split.kernel_rows.tolist() == [2, 3, 4]
    if expanded_in_kernel:
        assert split.expanded_rows.tolist() == [0, 1] and not split.expanded_groups
    else:
        assert not len(split.expanded_rows)
        assert split.expanded_groups[0].query_index.shape == (2, 37)
    assert torch.equal(cache.view(torch.uint8), copy.view(torch.uint8))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)

    invariant = dataclasses.replace(common, batch_invariant=True)
    metadata = MLACpuBackend.build_metadata(invariant)
    assert metadata.torch_metadata is not None
    assert torch.equal(MLACpuBackend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b,
                                             scale), want)


def test_query_tile_gives_every_thread_a_tile(monkeypatch):
    """Tiles of 4 x query_tile tokens: as long as possible (<= 64) with a tile per thread."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert [_query_tile(q) for q in (1, 16, 37, 100, 128, 4096)] == [2, 2, 5, 13, 16, 16]


def test_prefill_form_rule():
    """The rule at DeepSeek-V2-Lite's dimensions against the crossovers measured there
    (docs/mla.md): absorbed for chunks of 16 and 64 over a 2048-token prefix, expanded for 128
    and for fresh prefills; decodes always absorbed. A bad forced form is refused."""
    q = np.array([16, 64, 128, 16, 512, 1, 1])
    c = np.array([2048, 2048, 2048, 0, 0, 0, 4000])
    assert prefers_absorbed(q, q + c, (128, 64, 128, 512), ABSORBED_COST_FACTOR).tolist() == [
        True, True, False, False, False, True, True]
    with pytest.raises(ValueError, match="prefill_form"):
        MLACpuBackend.build_metadata(_step(56, 4, "auto", torch.float32)[4], "dense")


def test_expanded_kernel_refuses_a_value_size_off_its_lanes():
    """The kernel takes value sizes in fours: another is refused with the code named (the
    backend sends such layers' expanded rows to torch instead, and they stay exact)."""
    if not mla_expanded_prefill_supported():
        pytest.skip("this build has no expanded MLA kernel")
    qsl, seq_lens = np.array([0, 3], dtype=np.int32), np.array([3], dtype=np.int32)
    q_nope, q_pe = torch.randn(3, 2, 8), torch.randn(3, 2, 4)
    kv_nope, k_pe = torch.randn(3, 2, 8 + 6), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="bad sizes"):
        mla_expanded_prefill(q_nope, q_pe, kv_nope, k_pe, np.zeros(1, dtype=np.int64), qsl,
                             seq_lens, np.array([0], dtype=np.int32), 0.5, 64,
                             torch.zeros(3, 2, 6))
    q_nope, q_pe, latent, cache, common, w_kv_b = _step(56, 4, "auto", torch.float32)
    assert_expanded_rows_in_torch(q_nope, q_pe, latent, cache, common,
                                  w_kv_b[:, :DN + DV - 2])   # dv 22
