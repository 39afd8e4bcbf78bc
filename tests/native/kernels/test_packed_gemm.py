"""The packed-B GEMM (`native/kernels/csrc/packed_gemm.h`) against torch, in the native (AVX-512 where
the CPU has it), AVX2 and portable builds, and the engine with weight packing on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedllm.native.kernels.ops as ops
from pagedllm import LLM, SamplingParams
from pagedllm.core.sched_output import NewRequestData
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.kernel_builds import BUILD_PARAMS, kernel_build
from tests.fixtures.runner_steps import run_step

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

# (M, N, K): odd row counts over every register tile's remainder, N off the 16-column panels
# (a tail panel), K read whole, and K cut into 256-wide blocks (partial sums carried between
# blocks: the 48-row block of (50, 40, 1040) holds more than kMaxWholeK x values, its 2-row
# remainder fewer).
SHAPES = [(1, 40, 24), (3, 77, 264), (7, 129, 64), (33, 100, 520), (100, 48, 40),
          (515, 33, 16), (50, 40, 1040)]


@pytest.fixture(scope="module", params=BUILD_PARAMS)
def lib(request):
    return kernel_build(request.param)


def _operands(m: int, n: int, k: int, wdtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(wdtype)
    return w, torch.randn(m, k, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_fp32_matches_torch(lib, m, n, k, use_bias):
    w, x, b = _operands(m, n, k, torch.float32, seed=m + n)
    b = b if use_bias else None
    got = ops.packed_linear(x, ops.pack_linear_weight(w, lib), b, lib=lib)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 40, 24), (1, 1552, 768), (3, 77, 264), (0, 16, 8)],
                         ids=str)
def test_float32_fast_path_equals_general_path(m, n, k):
    """The float32 rows path (`lib` and bias left out, contiguous 2-D x) gives the general
    path's result bit for bit, a float32 [m, n] tensor, whatever the default dtype."""
    w, x, _ = _operands(m, n, k, torch.float32, seed=n + k)
    packed = ops.pack_linear_weight(w)
    general = ops.packed_linear(x, packed, lib=cpu_kernels())
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        fast = ops.packed_linear(x, packed)
    finally:
        torch.set_default_dtype(before)
    assert fast.dtype == torch.float32 and fast.shape == (m, n)
    assert torch.equal(fast, general)
    torch.testing.assert_close(fast, F.linear(x, w), atol=1e-4, rtol=1e-5)
    # Rows that are not contiguous (a column slice) take the general path.
    wide = torch.randn(max(m, 1), 2 * k)
    torch.testing.assert_close(ops.packed_linear(wide[:, :k], packed), F.linear(wide[:, :k], w),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_bf16_weights_match_torch(lib, m, n, k):
    """bf16 weights with float32 x: exact float32 math on x except on builds that multiply
    bf16 pairs (AVX512_BF16), which round x to bf16 first: there the result is that of the
    rounded x, tightly, and the fp32-x reference only loosely."""
    w, x, b = _operands(m, n, k, torch.bfloat16, seed=m * n)
    got = ops.packed_linear(x, ops.pack_linear_weight(w, lib), b, lib=lib)
    x_seen = x.bfloat16().float() if lib.packed_gemm_bf16_pairs() else x
    torch.testing.assert_close(got, F.linear(x_seen, w.float(), b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, F.linear(x, w.float(), b), atol=0.05 * k ** 0.5, rtol=0.02)


@pytest.mark.parametrize("m,n,k", SHAPES[:4], ids=str)
def test_bf16_activations_in_and_out(lib, m, n, k):
    w, x, b = _operands(m, n, k, torch.bfloat16, seed=7)
    got = ops.packed_linear(x.bfloat16(), ops.pack_linear_weight(w, lib), b, lib=lib)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.bfloat16().float(), w.float(), b)   # one rounding of the fp32 sums
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)


def test_pack_round_trip_and_layout(lib):
    w = torch.randn(37, 24).bfloat16()
    packed = ops.pack_linear_weight(w, lib)
    assert packed.shape == w.shape and packed.dtype == w.dtype
    assert not torch.equal(packed, w)          # rearranged, same element count
    torch.testing.assert_close(ops.unpack_linear_weight(packed, lib), w, atol=0, rtol=0)
    # Panel 0, k = 0: the first 16 columns' first values (pairs: interleaved with k = 1).
    step = 2 if lib.packed_gemm_bf16_pairs() else 1
    assert torch.equal(packed.reshape(-1)[:16 * step:step], w[:16, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_of_a_packed_weight(lib, dtype):
    """An embedding lookup on a packed weight gives its rows exactly, tail panel included, in
    the ids' shape; an id outside the weight is named and nothing is returned."""
    w = torch.randn(37, 24).to(dtype)
    packed = ops.pack_linear_weight(w, lib)
    ids = torch.tensor([[36, 0, 17], [16, 15, 36]])
    got = ops.packed_weight_rows(packed, ids, lib)
    assert got.shape == (2, 3, 24) and got.dtype == dtype
    assert torch.equal(got, w[ids])
    many = torch.randint(0, 37, (300,), generator=torch.Generator().manual_seed(5))
    assert torch.equal(ops.packed_weight_rows(packed, many, lib), w[many])   # threaded
    for bad in (37, -1):
        with pytest.raises(ValueError, match=r"ids outside \[0, 37\)"):
            ops.packed_weight_rows(packed, torch.tensor([3, bad]), lib)


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.pack_linear_weight(torch.randn(16, 12))
    packed = ops.pack_linear_weight(torch.randn(16, 8))
    with pytest.raises(ValueError, match="does not fit the weight"):
        ops.packed_linear(torch.randn(2, 16), packed)
    with pytest.raises(ValueError, match="bias"):
        ops.packed_linear(torch.randn(2, 8), packed, torch.randn(3))


# ---------------------------------------------------------------- engine level

def _prefill_logits(path: str, monkeypatch, packed: bool, fused: bool) -> torch.Tensor:
    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "1" if packed else "0")
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    model = runner.model.model
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj,
                                                      layer.mlp.down_proj)]
    assert all(m.quant_method.packed == packed for m in linears)
    assert all(m.weight.shape == (m.output_size_per_partition, m.input_size_per_partition)
               for m in linears)
    stack = model.layer_stack
    assert stack is not None and stack.fused.packed_weights == packed
    assert runner.model.lm_head.packed == packed     # an untied float head is packed too
    model.layer_stack = stack if fused else None
    tokens = torch.randint(3, 200, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    return run_step(runner, NewRequestData("a", tokens, [], greedy, [1, 2, 3], 0), len(tokens))


@pytest.mark.parametrize("fused", [True, False], ids=["fused_decoder", "module_path"])
def test_engine_logits_equal_with_packing_on_and_off(tiny_checkpoints, monkeypatch, fused):
    path = str(tiny_checkpoints["llama"])
    on = _prefill_logits(path, monkeypatch, packed=True, fused=fused)
    off = _prefill_logits(path, monkeypatch, packed=False, fused=fused)
    torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-4)


def test_reloading_a_packed_layer_unpacks_it(tiny_checkpoints, monkeypatch):
    """`load_weight` into a packed weight writes the [out, in] matrix; packing again after
    loading gives the same packed weight as before."""
    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "1")
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=8 << 20)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model.model
    layer = model.layers[0].mlp.down_proj
    method = layer.quant_method
    packed_before = layer.weight.data.clone()
    matrix = method.unpacked_weight(layer)
    method.load_weight(layer, matrix.clone(), None)
    assert not method.packed and torch.equal(layer.weight.data, matrix)
    method.process_weights_after_loading(layer)
    assert method.packed and torch.equal(layer.weight.data, packed_before)


def test_lm_head_packing_and_reload(tiny_checkpoints, monkeypatch):
    """An untied float LM head is packed after loading (its logits equal the unpacked GEMM's
    up to summation order); reloading it writes rows again, and processing repacks it."""
    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "1")
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=8 << 20)
    head = llm.llm_engine.engine_core.executor.worker.model_runner.model.lm_head
    assert head.packed and not head.tied
    packed_before = head.weight.data.clone()
    rows = ops.unpack_linear_weight(head.weight.data)
    hidden = torch.randn(3, rows.shape[1])
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ rows.T, atol=1e-5,
                               rtol=1e-5)
    head.weight_loader(head.weight, rows.clone())
    assert not head.packed and torch.equal(head.weight.data, rows)
    head.process_weights_after_loading()
    assert head.packed and torch.equal(head.weight.data, packed_before)


def test_tied_lm_head_packs_the_shared_weight(tiny_checkpoints, monkeypatch):
    """A tied head packs the weight it shares with the embedding: lookups give the same rows,
    the logits those of the rows, a reload through the embedding writes rows again and
    processing repacks; the engine's greedy tokens and logprobs equal those with packing off."""
    path = str(tiny_checkpoints["llama_mqa_tied_llama3"])
    prompts = [[5, 9, 33, 7, 120, 64, 3], [200, 11, 4]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    outputs = {}
    for packed in (True, False):
        monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "1" if packed else "0")
        llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        head, embed = model.lm_head, model.model.embed_tokens
        assert head.tied and head.weight is embed.weight
        assert head.packed == embed.packed == packed
        outputs[packed] = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
        if not packed:
            continue
        packed_before = head.weight.data.clone()
        rows = ops.unpack_linear_weight(head.weight.data)
        ids = torch.tensor([0, 7, rows.shape[0] - 1])
        assert torch.equal(embed(ids), rows[ids])
        hidden = torch.randn(2, rows.shape[1])
        torch.testing.assert_close(head.compute_logits(hidden), hidden @ rows.T, atol=1e-5,
                                   rtol=1e-5)
        embed.weight_loader(embed.weight, rows.clone())
        assert not head.packed and not embed.packed and torch.equal(embed.weight.data, rows)
        head.process_weights_after_loading()
        assert embed.packed and torch.equal(embed.weight.data, packed_before)
    for on, off in zip(outputs[True], outputs[False]):
        assert on.token_ids == off.token_ids
        for a, b in zip(on.logprobs, off.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


# ---------------------------------------------------------------- bf16 pair forms

@pytest.fixture
def pair_forms():
    """The native library when it packs bf16 pairs (else the test is skipped); the measured
    form is put back afterwards."""
    lib = cpu_kernels()
    measured = ops.packed_pairs_form(lib)
    if measured is None:
        pytest.skip("this library packs no bf16 pairs (no AVX512_BF16)")
    yield lib
    ops.set_packed_pairs_form(measured, lib)


def _forms(lib, fn):
    out = {}
    for form in ("dot", "widen"):
        ops.set_packed_pairs_form(form, lib)
        assert ops.packed_pairs_form(lib) == form
        out[form] = fn()
    return out


@pytest.mark.parametrize("m,n,k", SHAPES + [(32, 272, 512), (13, 31, 8), (47, 97 * 16, 72),
                                            (26, 48, 2056)], ids=str)
def test_pair_forms_same_bits_and_float64_oracle(pair_forms, m, n, k):
    """`vdpbf16ps` and the widening FMAs give the same bits (float32 and bf16 activations,
    register-tile remainders, tail panels, K blocks), both within float32 rounding of a
    float64 GEMM on the bf16-rounded x. The widening form's later passes over a panel pair
    read the panels its first pass widened (47 rows: 12 + 12 + 12 + 8 + 2 + 1; an odd panel
    count; K cut into blocks with 26 rows)."""
    lib = pair_forms
    w, x, b = _operands(m, n, k, torch.bfloat16, seed=m + 3 * n + k)
    x = x * torch.logspace(-3, 3, k)          # magnitudes that differ across k
    packed = ops.pack_linear_weight(w, lib)
    for act in (torch.float32, torch.bfloat16):
        got = _forms(lib, lambda: ops.packed_linear(x.to(act), packed, b, lib=lib))
        assert torch.equal(got["dot"], got["widen"]), act
        xr = x.bfloat16().double()
        want = xr @ w.double().T + b.double()
        bound = 2 * k * 2.0 ** -24 * (xr.abs() @ w.double().abs().T + b.double().abs())
        if act is torch.bfloat16:               # the output rounded to bf16 as well
            bound = bound + want.abs() * 2.0 ** -8
        for form, y in got.items():
            assert (y.double() - want).abs().le(bound).all(), (form, act)


def test_pair_forms_same_bits_in_the_engine(tiny_checkpoints, pair_forms, monkeypatch):
    """A bf16 model's greedy tokens and logprobs are the same with either pair form (the
    fused decoder's staged x included)."""
    lib = pair_forms
    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "1")
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", kv_cache_memory_bytes=8 << 20,
              enable_prefix_caching=False)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model.model
    assert model.layers[0].mlp.down_proj.quant_method.packed
    assert model.layer_stack is not None and model.layer_stack.fused.packed_weights
    prompts = [{"prompt_token_ids": [5, 9, 33, 7, 120, 64, 3, 8, 19]},
               {"prompt_token_ids": [200, 11, 4]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    got = _forms(lib, lambda: [o.outputs[0] for o in llm.generate(
        prompts, greedy, use_tqdm=False)])
    for a, b in zip(got["dot"], got["widen"]):
        assert a.token_ids == b.token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in a.logprobs] == \
            [{t: p.logprob for t, p in d.items()} for d in b.logprobs]


def test_set_pairs_form_rejects_bad_forms():
    with pytest.raises(ValueError, match="'dot' or 'widen'"):
        ops.set_packed_pairs_form("fast")
