"""The native MoE block (`native/moe_block.py`, `csrc/cpu_moe_block.cpp`) against the module
path of the same block (`native_block` None): tiny random DeepSeek-V2 (softmax greedy and
group-limited), DeepSeek-V3 (sigmoid, noaux_tc groups, correction bias, norm_topk_prob,
routed_scaling_factor) and Qwen3-Next / Qwen2-MoE (softmax top-k, norm_topk_prob, shared expert
with its sigmoid gate) blocks; float32 tight, bfloat16 within the fused-MoE tests' tolerance.
The end-to-end HF comparisons of these models (tests/models) run with it on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.layers.moe_routing import DeepseekRouting
from pagedllm.layers.quantization.base import process_weights_after_loading
from pagedllm.models.deepseek_v2 import DeepseekMoE
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.native.attach import refresh_native_decoder
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.moe_block import NativeMoeBlock, attach_native_moe
from pagedllm.platforms import current_platform

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

HIDDEN = 64


def _randomize(block: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in block.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.data.copy_(torch.rand(p.shape, generator=gen) * 0.2)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    process_weights_after_loading(block)   # the shared expert's linears packed, as at load


def _deepseek(routing: DeepseekRouting, n_shared: int = 2, seed: int = 0) -> DeepseekMoE:
    config = SimpleNamespace(hidden_size=HIDDEN, moe_intermediate_size=32,
                             n_shared_experts=n_shared, mlp_bias=False)
    block = DeepseekMoE(config, routing, "silu")
    _randomize(block, seed)
    return block


def _sparse(shared: int | None, renormalize: bool = True, seed: int = 0) -> SparseMoeBlock:
    block = SparseMoeBlock(HIDDEN, 8, 2, 48, renormalize, "silu",
                           shared_expert_intermediate_size=shared)
    _randomize(block, seed)
    return block


def _both_paths(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(native output, module-path output) of `block` on x."""
    native = NativeMoeBlock.for_block(block)
    assert native is not None
    block.native_block = native
    got = native(x)
    assert got is not None, "the native block declined the step"
    assert torch.equal(block(x), got)   # forward takes it
    block.native_block = None
    return got, block(x)


V2_GREEDY = DeepseekRouting(16, 3, "softmax", "greedy", routed_scaling_factor=1.5)
V2_GROUPS = DeepseekRouting(16, 3, "softmax", "group_limited_greedy", n_group=4, topk_group=2,
                            routed_scaling_factor=2.0)
V3 = DeepseekRouting(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5)
V3_UNNORMED = DeepseekRouting(16, 2, "sigmoid", "noaux_tc", n_group=8, topk_group=3)


@pytest.mark.parametrize("num_tokens", [1, 5, 33, 300])   # 300: prefill-sized blocks
@pytest.mark.parametrize("routing", [V2_GREEDY, V2_GROUPS, V3, V3_UNNORMED],
                         ids=["v2-greedy", "v2-groups", "v3-noaux", "v3-unnormed"])
def test_deepseek_block_float32(routing, num_tokens):
    block = _deepseek(routing)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    got, want = _both_paths(block, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_deepseek_block_without_shared_experts():
    block = _deepseek(V3, n_shared=0)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2))
    got, want = _both_paths(block, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 7, 40, 200])
@pytest.mark.parametrize("shared, renormalize", [(96, True), (96, False), (None, True)],
                         ids=["qwen3-next", "qwen2-moe", "qwen3-moe"])
def test_sparse_block_float32(shared, renormalize, num_tokens):
    block = _sparse(shared, renormalize)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    got, want = _both_paths(block, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 3, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("packed", [True, False], ids=["packed-router", "router-rows"])
def test_router_of_many_experts(num_tokens, dtype, packed, monkeypatch):
    """40 experts (the router's packed copy: two 16-expert panels and a tail panel of 8; with
    the packed GEMM switched off, its rows); float32 against the module path (torch's linear
    for the router) and a float64 evaluation of the whole block."""
    if not packed:
        monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "0")
    current_platform.configure_options()
    try:
        _check_router_of_many_experts(num_tokens, dtype, packed)
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_PACKED_GEMM", raising=False)
        current_platform.configure_options()


def _check_router_of_many_experts(num_tokens, dtype, packed):
    block = SparseMoeBlock(HIDDEN, 40, 4, 48, True, "silu", shared_expert_intermediate_size=None)
    _randomize(block, 4)
    block.to(dtype)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    got, want = _both_paths(block, x)
    assert block.native_block is None
    native = NativeMoeBlock.for_block(block)
    assert native.address(num_tokens, dtype) != 0 and native._weights.router_packed == packed
    assert torch.equal(native(x), got)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        return
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    xd = x.double()
    logits = xd @ block.gate.weight.double().T
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), 4, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    w13, w2 = block.experts.w13_weight.double(), block.experts.w2_weight.double()
    exact = torch.zeros_like(xd)
    for t in range(num_tokens):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = w13[e] @ xd[t]
            exact[t] += w * (w2[e] @ (torch.nn.functional.silu(h[:48]) * h[48:]))
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: _deepseek(V3), lambda: _deepseek(V2_GREEDY),
                                  lambda: _sparse(96)], ids=["v3", "v2", "qwen3-next"])
def test_blocks_bfloat16(make):
    """bf16 weights and activations: the intermediates rounded where the module path rounds
    them; the tolerance of the fused-MoE kernel's bf16 tests."""
    block = make().to(torch.bfloat16)
    if isinstance(block, DeepseekMoE):
        block.gate.float()   # HF keeps DeepSeek's router in float32
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got, want = _both_paths(block, x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("make", [lambda: _deepseek(V3), lambda: _deepseek(V2_GROUPS),
                                  lambda: _sparse(96)], ids=["v3", "v2-groups", "qwen3-next"])
def test_blocks_bfloat16_prefill_against_torch_gemms(make, monkeypatch):
    """A prefill-sized bf16 step (300 tokens: 56-75 rows per expert, the kernel's panel form)
    against the module path with the fused-MoE kernel off (torch bf16 GEMMs per expert):
    equal up to float32 summation order."""
    block = make().to(torch.bfloat16)
    if isinstance(block, DeepseekMoE):
        block.gate.float()
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    native = NativeMoeBlock.for_block(block)
    got = native(x)
    assert got is not None and got.dtype == torch.bfloat16
    monkeypatch.setenv("PAGEDLLM_CPU_FUSED_MOE", "0")
    current_platform.configure_options()
    try:
        block.native_block = None
        want = block(x)
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_FUSED_MOE")
        current_platform.configure_options()
    # Tokens whose k-th and (k+1)-th router logits tie (bf16 logits: a few of 300) may take
    # different experts (torch's top-k order on ties is unspecified); the rest must agree.
    ranked = block.gate(x).float().sort(dim=-1, descending=True).values
    untied = ranked[:, native.top_k - 1] != ranked[:, native.top_k]
    assert untied.float().mean() > 0.9
    torch.testing.assert_close(got[untied].float(), want[untied].float(), atol=2e-2, rtol=2e-2)


def test_declines_what_it_does_not_take(monkeypatch):
    """The switches, a replaced expert layer (LoRA's wrapper), load counting and routed-experts
    capture send the step to the module path (None); prefill-sized steps are taken in both
    dtypes (the kernel's panel form)."""
    block16 = _sparse(96).to(torch.bfloat16)
    native16 = NativeMoeBlock.for_block(block16)
    assert native16(torch.randn(600, HIDDEN).bfloat16()) is not None   # 150 rows per expert
    block = _sparse(96)
    native = NativeMoeBlock.for_block(block)
    x = torch.randn(2, HIDDEN)
    assert native(x) is not None
    assert native(x.double()) is None
    assert native(torch.randn(600, HIDDEN)) is not None   # 150 rows per expert
    experts = block.experts
    experts.expert_load = torch.zeros(8, dtype=torch.int64)
    assert native(x) is None
    experts.expert_load = None
    gate = block.shared_expert_gate
    block.shared_expert_gate = torch.nn.Identity()
    assert native(x) is None
    block.shared_expert_gate = gate
    block.experts = torch.nn.Identity()
    assert native(x) is None
    block.experts = experts
    assert native(x) is not None
    for var in ("PAGEDLLM_CPU_MOE_BLOCK", "PAGEDLLM_CPU_FUSED_MOE"):
        monkeypatch.setenv(var, "0")
        current_platform.configure_options()
        assert native(x) is None
        monkeypatch.delenv(var)
        current_platform.configure_options()
    assert native(x) is not None


def test_attach_and_unsupported_blocks():
    """`attach_native_moe` fills the slot of the blocks it supports and leaves None where the
    structure is outside the kernel (an intermediate size not a multiple of 8)."""
    model = torch.nn.ModuleList([_sparse(96), _deepseek(V3)])
    odd = SparseMoeBlock(HIDDEN, 4, 2, 20, True, "silu")
    model.append(odd)
    assert attach_native_moe(model) == 2
    assert model[0].native_block is not None and model[1].native_block is not None
    assert odd.native_block is None


def test_reloaded_weights_are_seen():
    """A weight whose storage is replaced after the first call (a reload, sleep mode) is read
    from its new storage once the runner says the weights changed (`refresh_native_decoder`,
    as `ModelRunner.weights_changed` calls it)."""
    block = _sparse(96)
    native = NativeMoeBlock.for_block(block)
    x = torch.randn(3, HIDDEN)
    first = native(x)
    block.experts.w2_weight.data = block.experts.w2_weight.data * 2
    block.native_block = native
    refresh_native_decoder(block)
    block.native_block = None
    want = block(x)
    got = native(x)
    assert not torch.equal(first, got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
