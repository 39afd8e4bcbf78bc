"""The native fused-MoE kernel (`csrc/cpu_fused_moe.cpp`, `ops.cpu_fused_moe`) against a naive
per-token loop and against `fused_experts_torch`; the dispatch in `fused_experts` / `FusedMoE`.
(The end-to-end HF comparisons of MoE models in tests/models/test_moe.py run with it on.)"""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.parallel_state import (ExpertParallelLayout,
                                                 set_expert_parallel_layout)
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.kernel_builds import BUILD_PARAMS, kernel_build
from pagedllm.native.kernels.ops import cpu_fused_moe, fused_moe_supported
from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.fused_moe import (FusedMoE, fused_experts, fused_experts_torch,
                                       native_moe_applies, select_experts)
from pagedllm.platforms import current_platform

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")


def _naive(hidden, w13, w2, topk_weights, local_ids):
    """Per token and slot, in float64: weight * down(silu(gate(x)) * up(x)) for local slots."""
    num_local, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for w, e in zip(topk_weights[t].tolist(), local_ids[t].tolist()):
            if not 0 <= e < num_local:
                continue
            h = w13[e].double() @ x
            out[t] += w * (w2[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def _problem(num_tokens, num_experts, hidden_size, inter, top_k, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) / hidden_size ** 0.5
    w2 = torch.randn(num_experts, hidden_size, inter, generator=gen) / inter ** 0.5
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("num_tokens, num_experts, hidden_size, inter, top_k", [
    (1, 8, 64, 96, 2),       # a batch-1 decode step
    (37, 8, 40, 56, 1),      # odd token count, sizes not multiples of the 6/3-row kernels
    (29, 8, 32, 24, 2),
    (13, 8, 16, 16, 8),      # every expert for every token
    (250, 3, 24, 32, 1),     # ~83 rows per expert: the panel form, a padded last panel
    (430, 2, 40, 56, 1),     # ~215 rows per expert: one panel block each
    (600, 2, 40, 56, 1),     # ~300 rows per expert: two panel blocks each (at most 256 rows)
])
def test_float32_matches_naive_loop(num_tokens, num_experts, hidden_size, inter, top_k):
    hidden, w13, w2, weights, ids = _problem(num_tokens, num_experts, hidden_size, inter, top_k)
    got = cpu_fused_moe(hidden, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.shape == hidden.shape
    torch.testing.assert_close(got.double(), _naive(hidden, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, fused_experts_torch(hidden, w13, w2, weights, ids,
                                                        torch.arange(num_experts), SiluAndMul()),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(got, cpu_fused_moe(hidden, w13, w2, weights, ids))  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_decode_row_count_matches_naive_loop(dtype):
    """Expert e gets exactly e + 1 rows (1..10): each few-row kernel shape (one weight pass for
    up to 8 rows), the 6-row passes past it, and column counts that are not multiples of the
    kernels' 4 / 3 / 2 weight rows (intermediate 56, hidden 40)."""
    num_experts = 10
    counts = torch.arange(1, num_experts + 1)
    ids = torch.repeat_interleave(torch.arange(num_experts), counts)
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))]
    hidden, w13, w2, _, _ = _problem(len(ids), num_experts, 40, 56, 1, dtype=dtype, seed=3)
    weights = torch.rand(len(ids), 1, generator=torch.Generator().manual_seed(1))
    got = cpu_fused_moe(hidden, w13, w2, weights, ids[:, None])
    want = _naive(hidden.float(), w13.float(), w2.float(), weights, ids[:, None])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def _rows_per_expert(counts: list[int], hidden_size: int, inter: int, dtype, seed: int):
    """A top-1 problem where expert e gets exactly counts[e] rows (in shuffled token order)."""
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    hidden, w13, w2, _, _ = _problem(len(ids), len(counts), hidden_size, inter, 1, dtype=dtype,
                                     seed=seed)
    weights = torch.rand(len(ids), 1, generator=torch.Generator().manual_seed(seed + 1))
    return hidden, w13, w2, weights, ids[:, None]


@pytest.mark.parametrize("build", BUILD_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_row_counts_at_sizes_of_sixteen(build, dtype):
    """Sizes that are multiples of 16 (hidden 112, intermediate 80): on AVX-512 builds every
    block of 1-12 rows takes the 16-lane one-pass kernels (`tile_gemm16`), 13 and 14 rows the
    8-lane ones; column counts that are not multiples of their 6 / 4 / 3 / 2 weight rows. Each
    build (native, AVX2 only, portable) against the float64 loop."""
    lib = kernel_build(build)
    hidden, w13, w2, weights, ids = _rows_per_expert(list(range(1, 15)), 112, 80, dtype, 5)
    got = cpu_fused_moe(hidden, w13, w2, weights, ids, lib=lib)
    want = _naive(hidden.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("build", BUILD_PARAMS)
def test_panel_form_panel_counts(build):
    """float32 prefill-sized blocks (>= 32 rows: the panel form) of 2, 3, 5, 6 and 10 panels and
    a 290-row expert cut into blocks of 160 and 130 rows (at most 256 per block): the AVX-512
    form's two-panel steps and its three-panel last step of an odd count, a padded last panel,
    weight row counts that are not multiples of its 12- and 8-row tiles (40, 56). Against
    the float64 loop; with only panel blocks, every build's outputs are the same bits (each
    output is the same k-ordered chain of multiply-adds in the AVX2 and AVX-512 forms)."""
    lib = kernel_build(build)
    hidden, w13, w2, weights, ids = _rows_per_expert([32, 47, 80, 96, 150, 290], 56, 40,
                                                     torch.float32, 7)
    got = cpu_fused_moe(hidden, w13, w2, weights, ids, lib=lib)
    torch.testing.assert_close(got.double(), _naive(hidden, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)
    if build == "avx2":
        assert torch.equal(got, cpu_fused_moe(hidden, w13, w2, weights, ids))


def _naive_bf16_rounded(hidden, w13, w2, topk_weights, local_ids):
    """The module path's bf16 rounding points in float64 math: gate and up rounded to bf16,
    silu(gate) and its product with up rounded, each expert output rounded, each weighted row
    rounded, the k rows summed and rounded once. [n, H] bf16."""
    inter = w2.shape[2]
    bf = lambda v: v.to(torch.bfloat16).double()
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for w, e in zip(topk_weights[t].tolist(), local_ids[t].tolist()):
            h = bf(w13[e].double() @ x)
            act = bf(bf(torch.nn.functional.silu(h[:inter])) * h[inter:])
            out[t] += bf(bf(w2[e].double() @ act) * w)
    return out.to(torch.bfloat16)


@pytest.mark.parametrize("build", BUILD_PARAMS)
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bfloat16_panel_form_against_float64(build, act_dtype):
    """bf16 weights in prefill-sized blocks (the panel form: widened tiles, float32 FMAs):
    blocks of 32 (one whole panel pair), 47 and 150 rows (padded last panels; a 96 + 54-row
    expert), 31 rows (the dot-product form beside it), weight row counts that are not
    multiples of the 12-row tiles (hidden 56, intermediate 40). float32 activations: the
    float64 loop on the same bf16 weights, tight; bf16 activations: the float64 loop rounded
    where the module path rounds, to one bf16 ulp of the output (summation order)."""
    lib = kernel_build(build)
    hidden, w13, w2, weights, ids = _rows_per_expert([32, 47, 31, 150], 56, 40,
                                                     torch.float32, 11)
    hidden, w13, w2 = hidden.to(act_dtype), w13.bfloat16(), w2.bfloat16()
    got = cpu_fused_moe(hidden, w13, w2, weights, ids, lib=lib)
    assert got.dtype == act_dtype
    if act_dtype == torch.float32:
        torch.testing.assert_close(got.double(), _naive(hidden, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)
        return
    want = _naive_bf16_rounded(hidden, w13, w2, weights, ids)
    ulp = 2.0 ** (torch.frexp(want.float().abs()).exponent - 8).float()   # bf16 ulp of want
    assert ((got.float() - want.float()).abs() <= ulp + 1e-6).float().mean() > 0.99
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(300, 4, 2), (1365, 16, 2)])
def test_bfloat16_prefill_matches_module_path(num_tokens, num_experts, top_k, weight_dtype):
    """Prefill-sized steps of bf16 activations (~150 / ~170 rows per expert: panel blocks of 96
    and the rest), bf16 or float32 weights, against `fused_experts_torch` (torch GEMMs per
    expert) at the sizes of Qwen3-Next's experts scaled down: equal up to float32 summation
    order, about one bf16 ulp (float32 weights, which torch's GEMMs do not mix with bf16
    activations: the float64 loop rounded where the module path rounds)."""
    hidden, w13, w2, weights, ids = _problem(num_tokens, num_experts, 64, 48, top_k, seed=12)
    hidden, w13, w2 = hidden.bfloat16(), w13.to(weight_dtype), w2.to(weight_dtype)
    got = cpu_fused_moe(hidden, w13, w2, weights, ids)
    if weight_dtype == torch.bfloat16:
        want = fused_experts_torch(hidden, w13, w2, weights, ids, torch.arange(num_experts),
                                   SiluAndMul())
    else:
        want = _naive_bf16_rounded(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    exact = _naive(hidden, w13, w2, weights, ids)
    assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()
    assert torch.equal(got, cpu_fused_moe(hidden, w13, w2, weights, ids))  # deterministic


def test_experts_without_tokens_and_non_local_experts():
    """Experts 0 and 5 get no rows; ids -1 and >= L (another rank's experts) are skipped, as
    `fused_experts_torch` skips pairs its expert map sends to -1."""
    hidden, w13, w2, weights, ids = _problem(31, 8, 32, 40, 3, seed=1)
    ids = torch.where((ids == 0) | (ids == 5), 1, ids)
    ids[3] = torch.tensor([2, 7, 2])                      # a token with no local expert
    local_ids = ids.clone()
    local_ids[ids == 2] = -1
    local_ids[ids == 7] = 8
    got = cpu_fused_moe(hidden, w13, w2, weights, local_ids)
    want = _naive(hidden, w13, w2, weights, local_ids)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros(32))
    expert_map = torch.tensor([0, 1, -1, 3, 4, 5, 6, -1])  # physical id -> local slot
    torch.testing.assert_close(got, fused_experts_torch(hidden, w13, w2, weights, ids,
                                                        expert_map, SiluAndMul()),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (45, 2), (200, 1)])
def test_bfloat16_close_to_torch_path(weight_dtype, num_tokens, top_k):
    """bf16 activations: rounded where the torch path rounds, so the two agree to about one bf16
    ulp of the result (the GEMMs' summation order differs); both near the float64 loop."""
    hidden, w13, w2, weights, ids = _problem(num_tokens, 8, 64, 48, top_k, seed=2)
    hidden, w13, w2 = hidden.bfloat16(), w13.to(weight_dtype), w2.to(weight_dtype)
    got = cpu_fused_moe(hidden, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    want = fused_experts_torch(hidden, w13, w2, weights, ids, torch.arange(8), SiluAndMul())
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    exact = _naive(hidden, w13, w2, weights, ids)
    assert (got.double() - exact).abs().max() < 0.05 * exact.abs().max()


def test_float32_activations_with_bfloat16_weights():
    hidden, w13, w2, weights, ids = _problem(9, 4, 32, 16, 2, seed=3)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    torch.testing.assert_close(cpu_fused_moe(hidden, w13, w2, weights, ids).double(),
                               _naive(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_empty_batch_and_no_local_pairs():
    hidden, w13, w2, weights, ids = _problem(0, 4, 16, 8, 2)
    assert cpu_fused_moe(hidden, w13, w2, weights, ids).shape == (0, 16)
    hidden, w13, w2, weights, ids = _problem(5, 4, 16, 8, 2)
    assert torch.equal(cpu_fused_moe(hidden, w13, w2, weights, torch.full_like(ids, -1)),
                       torch.zeros(5, 16))


def test_bad_operands_are_refused_naming_them():
    hidden, w13, w2, weights, ids = _problem(3, 4, 16, 8, 2)
    with pytest.raises(ValueError, match="multiples of 8"):
        cpu_fused_moe(hidden[:, :12], w13[:, :, :12].contiguous(), w2[:, :12], weights, ids)
    with pytest.raises(ValueError, match="w2"):
        cpu_fused_moe(hidden, w13, w2[:3], weights, ids)
    with pytest.raises(ValueError, match="local_ids"):
        cpu_fused_moe(hidden, w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="local_ids"):
        cpu_fused_moe(hidden, w13, w2, weights, ids.float())
    assert not fused_moe_supported(hidden.half(), w13, w2)
    assert not fused_moe_supported(hidden, w13.transpose(1, 2), w2)


@pytest.mark.slow   # builds the portable kernel library
def test_portable_build_matches_naive_loop():
    """The kernel compiled without AVX2/FMA (what such CPUs run), fp32 tight and bf16."""
    lib = kernel_build("portable")
    hidden, w13, w2, weights, ids = _problem(23, 8, 24, 40, 2, seed=4)
    ids[5, 1] = -1
    torch.testing.assert_close(cpu_fused_moe(hidden, w13, w2, weights, ids, lib=lib).double(),
                               _naive(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    got = cpu_fused_moe(hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids, lib=lib)
    want = cpu_fused_moe(hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------- dispatch

def test_dispatch_takes_the_kernel_for_small_steps_and_honours_the_switch(monkeypatch):
    hidden, w13, w2, weights, ids = _problem(5, 8, 32, 24, 2)
    expert_map = torch.arange(8)
    assert native_moe_applies(hidden, w13, w2, ids, expert_map, SiluAndMul())
    assert not native_moe_applies(hidden, w13, w2, ids, expert_map, GeluAndMul())
    assert not native_moe_applies(hidden[:, :20], w13[:, :, :20], w2[:, :20], ids,
                                  expert_map, SiluAndMul())     # H % 8 != 0: torch path
    torch.testing.assert_close(
        fused_experts(hidden, w13, w2, weights, ids, expert_map, SiluAndMul()),
        cpu_fused_moe(hidden, w13, w2, weights, ids), atol=0, rtol=0)
    monkeypatch.setenv("PAGEDLLM_CPU_FUSED_MOE", "0")
    current_platform.configure_options()     # no engine starts here to read it
    assert not native_moe_applies(hidden, w13, w2, ids, expert_map, SiluAndMul())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_native_equals_torch_path_and_still_counts_load(monkeypatch, dtype):
    """`FusedMoE.forward` with EPLB's layout (2 redundant experts: 10 physical slots, token
    pairs split over replicas) on the kernel equals it with PAGEDLLM_CPU_FUSED_MOE=off, and
    the load counter (logical ids) is filled on the native path too."""
    torch.manual_seed(5)
    num_experts, top_k, hidden_size, inter = 8, 2, 32, 48
    set_expert_parallel_layout(ExpertParallelLayout(True, 2, count_expert_load=True))
    try:
        layer = FusedMoE(num_experts, top_k, hidden_size, inter, renormalize=True)
    finally:
        set_expert_parallel_layout(ExpertParallelLayout())
    w13 = torch.randn(num_experts, 2 * inter, hidden_size) / hidden_size ** 0.5
    w2 = torch.randn(num_experts, hidden_size, inter) / inter ** 0.5
    layer.weight_loader(layer.w13_weight, w13, "w13")
    layer.weight_loader(layer.w2_weight, w2, "w2")
    layer.to(dtype)
    hidden, logits = torch.randn(11, hidden_size).to(dtype), torch.randn(11, num_experts)
    assert native_moe_applies(hidden, layer.w13_weight, layer.w2_weight,
                              torch.zeros(11, top_k, dtype=torch.int64), layer.expert_map,
                              layer.act_fn)
    native = layer(hidden, logits)
    _, ids = select_experts(logits, top_k, True)
    assert torch.equal(layer.take_expert_load(), torch.bincount(ids.flatten(), minlength=8))
    monkeypatch.setenv("PAGEDLLM_CPU_FUSED_MOE", "off")
    current_platform.configure_options()
    reference = layer(hidden, logits)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native.float(), reference.float(), atol=tol, rtol=tol)


def test_identity_maps_skip_the_gathers_and_a_rebalance_turns_them_off():
    """A layer without EP or redundant experts routes logical ids as its slots
    (`identity_maps`); after a placement that permutes the experts the maps are gathered
    again, and both give the output of the same experts run through the torch path."""
    torch.manual_seed(7)
    from pagedllm.distributed.eplb.policy import placement_from_physical_to_logical

    num_experts, top_k, hidden_size, inter = 6, 2, 16, 24
    layer = FusedMoE(num_experts, top_k, hidden_size, inter, renormalize=True)
    assert layer.identity_maps
    w13 = torch.randn(num_experts, 2 * inter, hidden_size) / hidden_size ** 0.5
    w2 = torch.randn(num_experts, hidden_size, inter) / inter ** 0.5
    layer.weight_loader(layer.w13_weight, w13, "w13")
    layer.weight_loader(layer.w2_weight, w2, "w2")
    hidden, logits = torch.randn(5, hidden_size), torch.randn(5, num_experts)
    weights, ids = select_experts(logits, top_k, True)
    reference = fused_experts_torch(hidden, w13, w2, weights, ids,
                                    torch.arange(num_experts), SiluAndMul())
    torch.testing.assert_close(layer(hidden, logits), reference, atol=1e-5, rtol=1e-5)
    # Slot s holds logical expert perm[s]: the weights move with the placement.
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    layer.set_placement(placement_from_physical_to_logical(perm.numpy()[None], num_experts, 0),
                        0)
    assert not layer.identity_maps
    layer.w13_weight.data.copy_(w13[perm])
    layer.w2_weight.data.copy_(w2[perm])
    torch.testing.assert_close(layer(hidden, logits), reference, atol=1e-5, rtol=1e-5)
