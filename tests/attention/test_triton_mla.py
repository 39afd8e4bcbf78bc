"""The Triton MLA backend (`mla_triton`: absorbed decode in `triton_mla_decode`, prefill chunks in
`triton_mla_prefill` or on the torch expanded form) against the torch reference `mla_torch`,
and each kernel alone against absorbed attention computed from the cache in torch (causal for
the prefill kernel): several requests of ragged lengths, block tables that are random
permutations of the blocks, decode-only, mixed and chunked-prefill steps (absorbed, expanded
and split between the forms), float32 / bfloat16 / int8 / fp8 latent caches, head counts not a
power of two and above one program's head block, split-K over the context, padded tokens; end
to end on a tiny
DeepSeek-V2-Lite checkpoint against HF's greedy tokens, and (slow) with int8 / fp8 latent
caches against mla_torch.

Without a GPU the kernels run on CPU tensors in triton's interpreter
(tests/attention/triton_interpreter.py); nothing here has run compiled on a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.attention.triton_interpreter import import_triton_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_ENV_BEFORE = os.environ.get("TRITON_INTERPRET")
KERNELS = import_triton_kernels(("triton_mla_decode", "triton_mla_prefill"), DEVICE)

from pagedllm.attention.backends.mla_torch import MLATorchBackend  # noqa: E402
from pagedllm.attention.backends.mla_triton import MLATritonBackend  # noqa: E402
from pagedllm.kv_cache_layout import (KV_CACHE_DTYPES, allocate_kv_cache,  # noqa: E402
                                      dequantize_kv, kv_cache_scales, write_cache_rows)
from tests.attention.test_triton_paged import _make_step  # noqa: E402

L, DR, DN, DV = 32, 8, 16, 16
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _latent_cache(kv_cache: torch.Tensor, cache_dtype: str, model_dtype: torch.dtype):
    """A one-tensor latent cache [1, num_blocks, block_size, 1, L + dr] of `cache_dtype`
    ("auto" = the model dtype) holding kv_cache[0]'s rows (quantized for int8 / fp8; fp8 with
    a per-tensor scale of 0.05, not the default 1.0, so that a scale left out shows)."""
    _, num_blocks, block_size, _, size = kv_cache.shape
    dtype = KV_CACHE_DTYPES.get(cache_dtype, model_dtype)
    cache = allocate_kv_cache(num_blocks, block_size, 1, size, dtype, kv_cache.device, num_kv=1)
    if dtype == torch.float8_e4m3fn:
        kv_cache_scales(cache).fill_(0.05)
    slots = torch.arange(num_blocks * block_size, device=kv_cache.device)
    write_cache_rows(cache, 0, kv_cache[0].reshape(-1, 1, size), slots)
    return cache


def _clone_cache(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a latent cache, int8 / fp8 scales included (clone() would drop them)."""
    if cache.element_size() != 1:
        return cache.clone()
    _, num_blocks, block_size, _, size = cache.shape
    copy = allocate_kv_cache(num_blocks, block_size, 1, size, cache.dtype, cache.device,
                             num_kv=1)
    copy.view(torch.uint8).copy_(cache.view(torch.uint8))
    kv_cache_scales(copy).copy_(kv_cache_scales(cache))
    return copy


def _mla_step(kind: str, num_heads: int, cache_dtype: str, dtype: torch.dtype,
              kv_lora_rank: int = L, block_size: int = 16, num_padded_tokens: int = 0):
    """(q_nope, q_pe, latent, latent cache, common, w_kv_b) of a random step of `kind`
    (test_triton_paged's steps: ragged contexts, permuted block tables, block 0 null)."""
    query, key, _, kv_cache, common = _make_step(kind, num_heads, 1, kv_lora_rank + DR,
                                                 block_size, dtype,
                                                 num_padded_tokens=num_padded_tokens)
    gen = torch.Generator().manual_seed(1)
    q_nope = torch.randn(query.shape[0], num_heads, DN, generator=gen).to(dtype).to(DEVICE)
    w_kv_b = (0.3 * torch.randn(num_heads, DN + DV, kv_lora_rank, generator=gen)).to(dtype)
    return (q_nope, query[..., kv_lora_rank:].contiguous(), key[:, 0],
            _latent_cache(kv_cache, cache_dtype, dtype), common, w_kv_b.to(DEVICE))


@pytest.mark.parametrize("kind,num_heads,cache_dtype,dtype,kv_lora_rank,prefill_form", [
    ("decode", 4, "auto", torch.float32, L, "auto"),
    ("mixed", 4, "auto", torch.float32, L, "auto"),         # one chunk absorbed, one expanded
    ("mixed", 20, "auto", torch.float32, 48, "auto"),       # 20 heads, L not a power of two
    ("decode", 4, "auto", torch.bfloat16, L, "auto"),
    ("mixed", 4, "int8", torch.float32, L, "auto"),
    ("mixed", 4, "fp8_e4m3", torch.float32, L, "auto"),
    ("mixed", 8, "int8", torch.bfloat16, L, "auto"),
    ("chunked", 4, "auto", torch.float32, L, "absorbed"),   # chunks over cached prefixes
    ("chunked", 20, "auto", torch.bfloat16, 48, "absorbed"),
    ("chunked", 4, "int8", torch.float32, L, "absorbed"),
    ("chunked", 4, "fp8_e4m3", torch.float32, L, "absorbed"),
    ("chunked", 4, "auto", torch.float32, L, "expanded"),
], ids=str)
def test_backend_matches_mla_torch(kind, num_heads, cache_dtype, dtype, kv_lora_rank,
                                   prefill_form):
    """Same cache writes (bit for bit) and outputs as the torch reference; padded tokens zero."""
    q_nope, q_pe, latent, cache, common, w_kv_b = _mla_step(
        kind, num_heads, cache_dtype, dtype, kv_lora_rank, num_padded_tokens=2)
    scale = (DN + DR) ** -0.5
    want_cache = _clone_cache(cache)
    want = MLATorchBackend.forward(q_nope, q_pe, latent, want_cache,
                                   MLATorchBackend.build_metadata(common), w_kv_b, scale)
    metadata = MLATritonBackend.build_metadata(common, prefill_form)
    assert len(metadata.decode_reqs) == sum(common.query_start_loc_cpu[1:]
                                            - common.query_start_loc_cpu[:-1] == 1)
    out = MLATritonBackend.forward(q_nope, q_pe, latent, cache, metadata, w_kv_b, scale)
    for split in metadata.splits.values():
        # auto, mixed: the chunk of 13 tokens over 3 cached is absorbed at L 32, not at L 48.
        num_absorbed = {"absorbed": len(metadata.prefill_rows), "expanded": 0,
                        "auto": int(kv_lora_rank == L)}[prefill_form]
        assert len(set(split.tiles[0].tolist())) == num_absorbed
    assert out.dtype == dtype and out.shape == want.shape
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    if cache.element_size() == 1:
        assert torch.equal(kv_cache_scales(cache), kv_cache_scales(want_cache))
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not out[common.num_actual_tokens:].any()


def _absorbed_reference(q_lat, q_pe, cache, common, reqs, scale):
    """softmax(scale (q_lat . c_kv + q_pe . k_pe)) @ c_kv per decode row, in float64 over the
    dequantized latents of each request, gathered position by position."""
    block_size = common.block_size
    rows = []
    for i, r in enumerate(reqs):
        pos = torch.arange(int(common.seq_lens_cpu[r]))
        slots = common.block_table[r].cpu().long()[pos // block_size] * block_size \
            + pos % block_size
        ctx = dequantize_kv(cache, 0, slots.to(cache.device), torch.float64)[:, 0]
        c_kv, k_pe = ctx[:, :q_lat.shape[-1]], ctx[:, q_lat.shape[-1]:]
        s = (q_lat[i].double() @ c_kv.T + q_pe[i].double() @ k_pe.T) * scale      # [H, S]
        rows.append(s.softmax(-1) @ c_kv)
    return torch.stack(rows)


@pytest.mark.parametrize("cache_dtype,num_heads,split_tokens,block_h", [
    ("auto", 4, 16, 64),      # several splits of one tile per request, uneven last split
    ("auto", 20, 24, 16),     # two head blocks; splits of two tiles (24 rounded up)
    ("int8", 4, 16, 64),
    ("fp8_e4m3", 4, 16, 64),
], ids=str)
def test_decode_kernel_split_k(cache_dtype, num_heads, split_tokens, block_h):
    """The kernel alone with short splits (up to 3 per request here) against absorbed
    attention from the cache; a request's result equals its result alone, where the grid has
    fewer splits (batch invariant)."""
    ops = KERNELS["triton_mla_decode"]
    _, q_pe, _, cache, common, _ = _mla_step("decode", num_heads, cache_dtype, torch.float32)
    reqs = torch.arange(common.num_reqs, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    q_lat = torch.randn(common.num_reqs, num_heads, L, generator=gen).to(DEVICE)
    # (_make_step leaves the decode tokens' latents unwritten: a random row is as good.)
    scales = kv_cache_scales(cache) if cache.element_size() == 1 else None
    scale = 0.2
    out = ops.mla_decode(q_lat, q_pe, cache, common.block_table, common.seq_lens, reqs, scale,
                         common.max_seq_len, scales=scales, split_tokens=split_tokens,
                         block_h=block_h)
    assert ops.num_kv_splits(common.max_seq_len, split_tokens) >= 2
    want = _absorbed_reference(q_lat, q_pe, cache, common, reqs.tolist(), scale)
    torch.testing.assert_close(out.double(), want.to(DEVICE), atol=2e-5, rtol=2e-5)
    r = 1                                            # 18 positions of the longest's 41
    alone = ops.mla_decode(q_lat[r:r + 1], q_pe[r:r + 1], cache, common.block_table,
                           common.seq_lens, reqs[r:r + 1], scale, int(common.seq_lens_cpu[r]),
                           scales=scales, split_tokens=split_tokens, block_h=block_h)
    assert torch.equal(alone[0], out[r])


def _causal_absorbed_reference(q_lat, q_pe, cache, common, rows, scale):
    """Causal absorbed attention of the chunks of `rows` (their tokens in order) in float64
    over the dequantized latents: [T, H, L]."""
    block_size = common.block_size
    qsl = common.query_start_loc_cpu
    outs, first = [], 0
    for r in rows:
        q_len, s = int(qsl[r + 1] - qsl[r]), int(common.seq_lens_cpu[r])
        pos = torch.arange(s)
        slots = common.block_table[r].cpu().long()[pos // block_size] * block_size \
            + pos % block_size
        ctx = dequantize_kv(cache, 0, slots.to(cache.device), torch.float64)[:, 0].cpu()
        c_kv, k_pe = ctx[:, :q_lat.shape[-1]], ctx[:, q_lat.shape[-1]:]
        t = slice(first, first + q_len)
        scores = (torch.einsum("thl,sl->ths", q_lat[t].double().cpu(), c_kv)
                  + torch.einsum("thr,sr->ths", q_pe[t].double().cpu(), k_pe)) * scale
        q_pos = s - q_len + torch.arange(q_len)
        scores = scores.masked_fill(pos[None, None] > q_pos[:, None, None], float("-inf"))
        outs.append(scores.softmax(-1) @ c_kv)
        first += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("cache_dtype,num_heads,block_q,block_h", [
    ("auto", 20, 2, 16),     # two head blocks, the second with 4 heads of 16
    ("int8", 4, 4, 4),       # tiles of 4 tokens: a chunk's last tile short
    ("fp8_e4m3", 4, 16, 4),
], ids=str)
def test_prefill_kernel_matches_causal_reference(cache_dtype, num_heads, block_q, block_h):
    """The prefill kernel alone, chunks over cached prefixes (tiles crossing block and latent
    tile boundaries) against causal absorbed attention from the cache in float64."""
    ops = KERNELS["triton_mla_prefill"]
    _, _, _, cache, common, _ = _mla_step("chunked", num_heads, cache_dtype, torch.float32)
    # (_make_step leaves the new tokens' latents unwritten: random rows are as good.)
    rows = np.arange(common.num_reqs)
    num_tokens = common.num_actual_tokens
    gen = torch.Generator().manual_seed(3)
    q_lat = torch.randn(num_tokens, num_heads, L, generator=gen).to(DEVICE)
    q_pe = torch.randn(num_tokens, num_heads, DR, generator=gen).to(DEVICE)
    tiles = ops.plan_query_tiles(common.query_start_loc_cpu, common.seq_lens_cpu, rows, block_q)
    assert tiles.shape[1] == sum(-(-q // block_q) for q in np.diff(common.query_start_loc_cpu))
    scales = kv_cache_scales(cache) if cache.element_size() == 1 else None
    out = ops.mla_prefill(q_lat, q_pe, cache, common.block_table,
                          torch.from_numpy(tiles).to(DEVICE), block_q, block_h, 0.2,
                          scales=scales)
    want = _causal_absorbed_reference(q_lat, q_pe, cache, common, rows, 0.2)
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="block_h 24"):
        ops.mla_prefill(q_lat, q_pe, cache, common.block_table,
                        torch.from_numpy(tiles).to(DEVICE), 1, 24, 0.2, scales=scales)
    with pytest.raises(ValueError, match="tiles must be int32"):
        ops.mla_prefill(q_lat, q_pe, cache, common.block_table,
                        torch.from_numpy(tiles).long().to(DEVICE), block_q, block_h, 0.2,
                        scales=scales)


def test_bad_inputs_are_refused():
    ops = KERNELS["triton_mla_decode"]
    _, q_pe, _, cache, common, _ = _mla_step("decode", 4, "int8", torch.float32)
    reqs = torch.arange(common.num_reqs, dtype=torch.int32, device=DEVICE)
    q_lat = torch.zeros(common.num_reqs, 4, L, device=DEVICE)
    args = (common.block_table, common.seq_lens, reqs, 0.2, common.max_seq_len)
    with pytest.raises(ValueError, match="needs its contiguous float32 scales"):
        ops.mla_decode(q_lat, q_pe, cache, *args)
    with pytest.raises(ValueError, match="does not fit queries of L=16"):
        ops.mla_decode(q_lat[..., :16], q_pe, cache, *args, scales=kv_cache_scales(cache))
    with pytest.raises(ValueError, match="block_h 24"):
        ops.mla_decode(q_lat, q_pe, cache, *args, scales=kv_cache_scales(cache), block_h=24)


def test_interpreter_setting_does_not_leak():
    assert os.environ.get("TRITON_INTERPRET") == _ENV_BEFORE


def test_selection(monkeypatch):
    """MLA layers follow the platform's attention backend: triton_paged -> mla_triton."""
    from pagedllm.attention.backends.selector import get_mla_attention_backend
    from pagedllm.platforms import current_platform

    for name, want in (("triton_paged", "mla_triton"), ("torch_sdpa", "mla_torch")):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", name)
        current_platform.configure_options()     # what an engine start does
        assert get_mla_attention_backend().name == want


@pytest.mark.slow   # ~10 s: the interpreter runs every decode step
def test_engine_greedy_tokens_match_hf(tmp_path, byte_level_tokenizer_dir, monkeypatch):
    """A tiny DeepSeek-V2-Lite checkpoint on mla_triton (interpreted without a GPU), with
    7-token chunked prefill (decode rows in the kernel beside expanded prefill chunks) and
    prefix caching: HF's greedy tokens, generated and prompt logprobs within 1e-4."""
    from pagedllm.layers.mla_attention import MLAAttention
    from tests.models.test_deepseek import (_assert_close_to_hf, _llm, _model, _params,
                                            _prompts, build_checkpoint, hf_greedy_reference)

    path = build_checkpoint("v2_lite", tmp_path / "v2_lite", byte_level_tokenizer_dir)
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton_paged")
    llm = _llm(path, block_size=8, max_num_batched_tokens=7, enable_prefix_caching=True,
               max_num_seqs=4)
    layers = _model(llm).attention_layers()
    assert {type(a) for a in layers} == {MLAAttention}
    assert {a.backend.name for a in layers} == {"mla_triton"}
    _assert_close_to_hf(llm.generate(_prompts(), _params(prompt_logprobs=True), use_tqdm=False),
                        hf_greedy_reference(path))


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_engine_quantized_latent_cache_matches_mla_torch(tmp_path, byte_level_tokenizer_dir,
                                                         monkeypatch, kv_cache_dtype):
    """With an int8 / fp8 latent cache, mla_triton (in-kernel dequantization) and mla_torch
    (dequantized gathers) read the same stored values: equal greedy tokens, logprobs within
    1e-4."""
    from tests.models.test_deepseek import _llm, _model, _params, _prompts, build_checkpoint
    from tests.models.test_gemma import _tokens_and_logprobs

    path = build_checkpoint("v2_lite", tmp_path / "v2_lite", byte_level_tokenizer_dir)
    results = {}
    for backend, mla in (("torch_sdpa", "mla_torch"), ("triton_paged", "mla_triton")):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
        llm = _llm(path, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16)
        assert _model(llm).attention_layers()[0].backend.name == mla
        results[mla] = _tokens_and_logprobs(llm.generate(_prompts(), _params(), use_tqdm=False))
    assert results["mla_triton"][0] == results["mla_torch"][0]
    torch.testing.assert_close(torch.tensor(sum(results["mla_triton"][1], [])),
                               torch.tensor(sum(results["mla_torch"][1], [])), atol=1e-4, rtol=0)
