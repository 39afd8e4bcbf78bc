"""The Triton paged-attention backend against the torch_sdpa backend (the oracle) on small mixed
steps: head sizes 64/80/96/128, GQA ratios 1-4, block sizes 16/32, decode-only, prefill-only,
mixed and chunked-prefill continuations, sliding windows, soft-capping, encoder (non-causal)
steps, padded batches, bidirectional image spans (`attend_until`, Gemma 3; also end to end
against HF), and the reshape-and-cache kernel alone.

On a GPU the kernels run compiled on CUDA tensors; without one they run on CPU tensors in triton's
interpreter. The interpreter is chosen when `@triton.jit` decorates a function, and triton's own
library (`tl.sum`, `tl.zeros`, ...) is decorated when triton is imported: so without a GPU this
module imports triton and the kernel modules with TRITON_INTERPRET=1 and restores the environment
right after (nothing leaks into other tests or the subprocesses they start); if triton was
already imported in this process without the interpreter, the module is skipped. The interpreter
is slow: the default cases keep to a covering subset, the full product is marked slow.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from tests.attention.triton_interpreter import import_triton_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_ENV_BEFORE = os.environ.get("TRITON_INTERPRET")
KERNELS = import_triton_kernels(("triton_unified_attention", "triton_reshape_and_cache"),
                                DEVICE)

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from pagedllm.attention.backends.triton_paged import TritonPagedBackend  # noqa: E402
from pagedllm.attention.metadata import CommonAttentionMetadata  # noqa: E402


# Cached context and query length per request, per kind of step.
STEPS = {
    "decode": ([5, 17, 40, 0, 31], [1, 1, 1, 1, 1]),
    "prefill": ([0, 0, 0], [7, 19, 33]),
    "mixed": ([0, 20, 35, 3], [9, 1, 1, 13]),
    "chunked": ([16, 45, 31], [16, 8, 21]),
}
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _make_step(kind: str, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               dtype: torch.dtype, seed: int = 0, num_padded_tokens: int = 0,
               causal: bool = True):
    """A random step: (query, key, value, kv_cache, common). The cached context is already in
    the cache (random blocks, block 0 left null); the new tokens' slots follow it."""
    ctx, q_lens = (np.array(x, dtype=np.int64) for x in STEPS[kind])
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    seq_lens = ctx + q_lens
    num_reqs = len(ctx)
    blocks_per_req = -(-seq_lens // block_size)
    num_blocks = int(blocks_per_req.sum()) + 3
    perm = rng.permutation(np.arange(1, num_blocks))
    block_table = np.zeros((num_reqs, int(blocks_per_req.max()) + 1), dtype=np.int32)
    used = 0
    for r in range(num_reqs):
        block_table[r, :blocks_per_req[r]] = perm[used:used + blocks_per_req[r]]
        used += blocks_per_req[r]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache[:, 0] = 0
    slots = np.concatenate([
        block_table[r, np.arange(ctx[r], seq_lens[r]) // block_size].astype(np.int64) * block_size
        + np.arange(ctx[r], seq_lens[r]) % block_size for r in range(num_reqs)])
    slots = np.concatenate([slots, np.full(num_padded_tokens, -1)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n = int(qsl[-1])
    num_tokens = n + num_padded_tokens
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(DEVICE), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(DEVICE),
        seq_lens_cpu=seq_lens.astype(np.int32),
        block_table=torch.from_numpy(block_table).to(DEVICE),
        slot_mapping=torch.from_numpy(slots).to(DEVICE), num_reqs=num_reqs,
        num_actual_tokens=n, max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
        block_size=block_size, causal=causal)
    query = randn(num_tokens, num_heads, head_size).to(DEVICE)
    key = randn(num_tokens, num_kv_heads, head_size).to(DEVICE)
    value = randn(num_tokens, num_kv_heads, head_size).to(DEVICE)
    return query, key, value, kv_cache.to(DEVICE), common


def _check_against_sdpa(kind, num_heads, num_kv_heads, head_size, block_size, dtype,
                        sliding_window=None, logits_soft_cap=None, num_padded_tokens=0,
                        causal=True):
    query, key, value, kv_cache, common = _make_step(
        kind, num_heads, num_kv_heads, head_size, block_size, dtype,
        num_padded_tokens=num_padded_tokens, causal=causal)
    scale = head_size ** -0.5
    want_cache = kv_cache.clone()
    want = TorchSDPABackend.forward(query, key, value, want_cache,
                                    TorchSDPABackend.build_metadata(common), scale,
                                    sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap)
    out = TritonPagedBackend.forward(query, key, value, kv_cache,
                                     TritonPagedBackend.build_metadata(common), scale,
                                     sliding_window=sliding_window,
                                     logits_soft_cap=logits_soft_cap)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(kv_cache, want_cache, atol=0, rtol=0)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    if num_padded_tokens:
        assert not out[common.num_actual_tokens:].any()


# (kind, num_heads, num_kv_heads, head_size, block_size, dtype): covers every head size, GQA
# ratio (incl. 3, not a power of two), block size, step kind and dtype at least once.
DEFAULT_CASES = [
    ("mixed", 4, 4, 64, 16, torch.float32),
    ("chunked", 4, 2, 80, 16, torch.float32),
    ("decode", 8, 2, 128, 32, torch.bfloat16),
    ("prefill", 4, 1, 96, 32, torch.float16),
    ("mixed", 6, 2, 64, 16, torch.bfloat16),
    ("chunked", 8, 2, 80, 32, torch.float16),
    ("decode", 2, 2, 80, 16, torch.float32),
    ("prefill", 4, 2, 128, 16, torch.float32),
]


@pytest.mark.parametrize("kind,num_heads,num_kv_heads,head_size,block_size,dtype",
                         DEFAULT_CASES, ids=str)
def test_matches_torch_sdpa(kind, num_heads, num_kv_heads, head_size, block_size, dtype):
    _check_against_sdpa(kind, num_heads, num_kv_heads, head_size, block_size, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_sdpa_full(kind, head_size, ratio, block_size, dtype):
    _check_against_sdpa(kind, 2 * ratio, 2, head_size, block_size, dtype)


@pytest.mark.parametrize("sliding_window,logits_soft_cap",
                         [(1, None), (5, None), (24, None), (None, 5.0), (7, 2.0)])
def test_sliding_window_and_soft_cap(sliding_window, logits_soft_cap):
    # Windows inside one block, across blocks; the chunked step's queries start mid-context,
    # so whole blocks before the window are skipped.
    _check_against_sdpa("chunked", 4, 2, 64, 16, torch.float32, sliding_window=sliding_window,
                        logits_soft_cap=logits_soft_cap)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("sliding_window,logits_soft_cap",
                         [(1, None), (3, None), (17, None), (100, None), (None, 2.0), (5, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_window_and_soft_cap_full(kind, sliding_window, logits_soft_cap, dtype):
    _check_against_sdpa(kind, 6, 2, 80, 16, dtype, sliding_window=sliding_window,
                        logits_soft_cap=logits_soft_cap)


def test_encoder_step_is_not_causal():
    # MHA: torch_sdpa (the oracle) mis-shapes its non-causal mask for GQA prefill groups.
    _check_against_sdpa("prefill", 4, 4, 64, 16, torch.float32, causal=False)


def test_padded_tokens_are_zero_and_not_written():
    """A CUDA-graph style batch: rows past num_actual_tokens with slot -1."""
    _check_against_sdpa("decode", 4, 2, 64, 16, torch.float32, num_padded_tokens=3)


def test_cuda_graph_padded_decode_matches_unpadded():
    """A decode step copied into the CUDA-graph input buffers and padded to a capture size (what
    a replay computes) gives the step's outputs and KV writes; padding writes nothing."""
    from pagedllm.worker.cuda_graph import CudaGraphInputBuffers

    query, key, value, kv_cache, common = _make_step("decode", 4, 2, 64, 16, torch.float32)
    n, padded = common.num_reqs, 8
    scale = 64 ** -0.5
    want_cache = kv_cache.clone()
    want = TritonPagedBackend.forward(query, key, value, want_cache,
                                      TritonPagedBackend.build_metadata(common), scale)
    buffers = CudaGraphInputBuffers(max_num_seqs=16, max_num_blocks_per_req=8, device=DEVICE)
    ids = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    (padded_common,) = buffers.prepare(ids, ids, [common], padded)

    def pad(t):
        return torch.cat([t, torch.randn(padded - n, *t.shape[1:]).to(t)])

    out = TritonPagedBackend.forward(pad(query), pad(key), pad(value), kv_cache,
                                     TritonPagedBackend.build_metadata(padded_common), scale)
    torch.testing.assert_close(out[:n], want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kv_cache, want_cache, atol=0, rtol=0)


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.float16)], ids=str)
def test_reshape_and_cache(src_dtype, cache_dtype):
    reshape_and_cache = KERNELS["triton_reshape_and_cache"].reshape_and_cache
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_size = 6, 16, 3, 80
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)
    key_cache, value_cache = key_cache.to(cache_dtype).to(DEVICE), value_cache.to(
        cache_dtype).to(DEVICE)
    key = torch.randn(10, kv_heads, head_size, generator=gen).to(src_dtype).to(DEVICE)
    value = torch.randn(10, kv_heads, head_size, generator=gen).to(src_dtype).to(DEVICE)
    slots = torch.tensor([17, 3, -1, 95, 40, 41, -1, 64, 0, 80], device=DEVICE)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    want_k.view(-1, kv_heads, head_size)[slots[keep]] = key[keep].to(cache_dtype)
    want_v.view(-1, kv_heads, head_size)[slots[keep]] = value[keep].to(cache_dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, want_v, atol=0, rtol=0)


def test_bad_shapes_are_refused():
    ops = KERNELS["triton_unified_attention"]
    query, _, _, kv_cache, common = _make_step("decode", 3, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        ops.unified_attention(query, kv_cache[0], kv_cache[1], torch.empty_like(query),
                              common.query_start_loc, common.seq_lens, common.block_table,
                              common.num_actual_tokens, 1, 0.125)
    with pytest.raises(ValueError, match="do not fit queries"):
        ops.unified_attention(query[..., :32], kv_cache[0], kv_cache[1],
                              torch.empty_like(query[..., :32]), common.query_start_loc,
                              common.seq_lens, common.block_table, common.num_actual_tokens, 1,
                              0.125)


def test_interpreter_setting_does_not_leak():
    assert os.environ.get("TRITON_INTERPRET") == _ENV_BEFORE


def test_selection(monkeypatch):
    from pagedllm.attention.backends.selector import get_attention_backend
    from pagedllm.platforms import current_platform
    from pagedllm.platforms.cuda import CudaPlatform

    monkeypatch.delenv("PAGEDLLM_ATTENTION_BACKEND", raising=False)
    assert CudaPlatform().attention_backend_name() == "triton_paged"
    for name in ("torch_sdpa", "triton_paged"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", name)
        current_platform.configure_options()     # what an engine start does
        assert CudaPlatform().attention_backend_name() == name
        assert get_attention_backend().name == name


def test_query_blocks_cover_every_token():
    """The grid's layout of query blocks (request r starts at query_start_loc[r] // BLOCK_Q + r)
    leaves no gaps and no overlaps for any lengths, zero-length queries included."""
    from pagedllm.attention.ops.triton_unified_attention import _launch_shape

    rng = np.random.default_rng(0)
    for rep, _ in itertools.product([1, 2, 3, 4, 8], range(20)):
        block_q, block_m = _launch_shape(rep)
        assert block_m >= 16 and block_q * rep <= block_m
        q_lens = rng.integers(0, 40, rng.integers(1, 8))
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        starts = qsl[:-1] // block_q + np.arange(len(q_lens))
        grid = qsl[-1] // block_q + len(q_lens)
        covered = []
        for g in range(grid):
            r = int(np.searchsorted(starts, g, side="right") - 1)
            local = g - starts[r]
            covered += [int(qsl[r]) + i for i in range(local * block_q, (local + 1) * block_q)
                        if i < q_lens[r]]
        assert sorted(covered) == list(range(int(qsl[-1])))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "llama_mqa_tied_llama3", "gemma2"])
def test_engine_greedy_tokens_match_torch_sdpa(tiny_checkpoints, arch, monkeypatch):
    """End to end through the engine: chunked prefill (32-token budget), decodes and prefix-cache
    hits (repeated prompts) give the same greedy tokens with both backends; Gemma 2 adds sliding
    windows and attention-logit soft-capping."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.attention import Attention

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]
    prompts += prompts[-2:]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for name in ("torch_sdpa", "triton_paged"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", name)
        llm = LLM(str(tiny_checkpoints[arch]), dtype="float32", kv_cache_memory_bytes=16 << 20,
                  max_num_batched_tokens=32)
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        assert {m.backend.name for m in model.modules() if isinstance(m, Attention)} == {name}
        tokens[name] = [o.outputs[0].token_ids
                        for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton_paged"] == tokens["torch_sdpa"]


# Image spans per step kind: (request, first query index, number of tokens). They cross the
# kernel's query blocks (8 tokens at GQA ratio 2) and KV tiles (32 positions), end at a
# request's last query, start at its first (right after a cached context), sit two to a request
# and beside decodes of the same step.
IMAGE_SPANS = {
    "chunked": [(0, 3, 12), (1, 0, 8), (2, 0, 11), (2, 14, 7)],
    "mixed": [(0, 2, 6), (3, 4, 9)],
    "prefill": [(0, 1, 5), (1, 6, 11), (2, 20, 13)],
}


def _with_attend_until(common: CommonAttentionMetadata, spans) -> CommonAttentionMetadata:
    """`common` with `attend_until` set as the runner sets it: each token's own position,
    the span's last position for the tokens of an image span."""
    from dataclasses import replace

    qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu.astype(np.int64)
    q_lens = np.diff(qsl)
    attend_until = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    for r, first, length in spans:
        start = int(qsl[r]) + first
        attend_until[start:start + length] = attend_until[start + length - 1]
    return replace(common, attend_until=torch.from_numpy(attend_until).to(DEVICE))


@pytest.mark.parametrize("kind,num_heads,dtype,sliding_window,logits_soft_cap", [
    ("chunked", 4, torch.float32, None, None),
    ("mixed", 4, torch.float32, 8, None),
    ("prefill", 8, torch.bfloat16, None, None),
    ("chunked", 6, torch.float32, 5, 3.0),
], ids=str)
def test_attend_until_matches_torch_sdpa(kind, num_heads, dtype, sliding_window,
                                         logits_soft_cap):
    """Bidirectional image spans (CommonAttentionMetadata.attend_until): each query's horizon
    comes from it; the sliding window still counts from the query's own position."""
    query, key, value, kv_cache, common = _make_step(kind, num_heads, 2, 64, 16, dtype)
    common = _with_attend_until(common, IMAGE_SPANS[kind])
    scale = 64 ** -0.5
    want_cache = kv_cache.clone()
    want = TorchSDPABackend.forward(query, key, value, want_cache,
                                    TorchSDPABackend.build_metadata(common), scale,
                                    sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap)
    causal = TorchSDPABackend.forward(query, key, value, want_cache.clone(),
                                      TorchSDPABackend.build_metadata(
                                          _with_attend_until(common, [])), scale,
                                      sliding_window=sliding_window,
                                      logits_soft_cap=logits_soft_cap)
    assert (want - causal).abs().max() > 0.05     # the spans change the outputs
    out = TritonPagedBackend.forward(query, key, value, kv_cache,
                                     TritonPagedBackend.build_metadata(common), scale,
                                     sliding_window=sliding_window,
                                     logits_soft_cap=logits_soft_cap)
    torch.testing.assert_close(kv_cache, want_cache, atol=0, rtol=0)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


def test_bad_attend_until_is_refused():
    ops = KERNELS["triton_unified_attention"]
    query, _, _, kv_cache, common = _make_step("prefill", 4, 2, 64, 16, torch.float32)
    n = common.num_actual_tokens
    for bad in (torch.zeros(n - 1, dtype=torch.int64, device=DEVICE),
                torch.zeros(n, dtype=torch.float32, device=DEVICE),
                torch.zeros(2 * n, dtype=torch.int64, device=DEVICE)[::2]):
        with pytest.raises(ValueError, match="attend_until must be"):
            ops.unified_attention(query, kv_cache[0], kv_cache[1], torch.empty_like(query),
                                  common.query_start_loc, common.seq_lens, common.block_table,
                                  n, common.max_query_len, 0.125, attend_until=bad)
    with pytest.raises(ValueError, match="causal steps only"):
        ops.unified_attention(query, kv_cache[0], kv_cache[1], torch.empty_like(query),
                              common.query_start_loc, common.seq_lens, common.block_table, n,
                              common.max_query_len, 0.125, causal=False,
                              attend_until=torch.zeros(n, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("kwargs,rounds", [
    ({"max_num_batched_tokens": 8}, 1),      # ~5 s (20 s on a loaded machine): the interpreter
    pytest.param({}, 2, marks=pytest.mark.slow)], ids=["chunked", "prefix_cached"])
def test_gemma3_images_equal_hf_in_the_kernel(tmp_path, monkeypatch, kwargs, rounds):
    """End to end: a tiny Gemma 3 with images (bidirectional soft tokens, a sliding and a global
    layer) on triton_paged gives HF's greedy tokens and chosen-token logprobs (they tell the
    bidirectional mask from a causal one), with 8-token chunks (an image's soft tokens stay in
    one chunk, after a cached context), and unchunked with a second round hitting the prefix
    cache."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.attention import Attention
    from tests.fixtures.vlm import build_tiny_gemma3_vision, draw_image

    path = build_tiny_gemma3_vision(tmp_path / "gemma3")
    images = [draw_image(56, 40, 1), draw_image(64, 16, 2)]
    text = "A <start_of_image> and <start_of_image> too"
    processor = AutoProcessor.from_pretrained(path)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        g = hf.generate(**inputs, max_new_tokens=3, do_sample=False, output_scores=True,
                        return_dict_in_generate=True)
    want = g.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    want_lp = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(g.scores, want)]
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton_paged")
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 21,
              **kwargs)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert {m.backend.name for m in model.modules()
            if isinstance(m, Attention)} == {"triton_paged"}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    for _ in range(rounds):
        [out] = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], params,
                             use_tqdm=False)
        completion = out.outputs[0]
        assert completion.token_ids == want
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(want_lp, abs=1e-4)
