"""The int8 linear kernels (csrc/cpu_int8_linear.cpp, `quantized_ops.int8_linear`) against torch references
on odd shapes: weight-only int8 against x @ (Wq * scale)^T in float64, W8A8 against exact
integer dot products of the torch per-token quantization; the quantization formulas themselves;
the portable (no-AVX2) build (slow); and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedllm.native.kernels.ops as ops
import pagedllm.native.kernels.quantized_ops as quantized_ops
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.kernel_builds import kernel_build
from pagedllm.layers.quantization.int8 import (quantize_activations_per_token,
                                               quantize_weight_per_channel)

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

# (M, N, K): batch 1 and more, K below / not a multiple of the 8- and 32-wide vector bodies.
SHAPES = [(1, 7, 13), (1, 64, 96), (2, 5, 1), (5, 33, 40), (6, 130, 257), (13, 64, 100),
          (100, 19, 64)]


def _weight_only_reference(x, qweight, scale, bias):
    w = qweight.double() * scale.double()[:, None]
    return F.linear(x.double(), w, bias.double()).float()


def _w8a8_reference(x, qweight, scale, bias):
    xq, xs = quantize_activations_per_token(x)
    acc = (xq.long() @ qweight.long().T).float()           # exact integer sums
    return acc * xs[:, None] * scale + bias


def test_quantize_weight_per_channel_formula():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -2.9, 0.01]])
    q, scale = quantize_weight_per_channel(w)
    torch.testing.assert_close(scale, torch.tensor([1.0, 0.0, 3.0]) / 127)
    assert q.dtype == torch.int8
    assert q[0].tolist() == [64, -127, 32, 0]              # 63.5 rounds half to even
    assert q[1].tolist() == [0, 0, 0, 0]
    assert q[2].tolist() == [127, 64, -123, 0]             # 63.5 -> 64, -122.77 -> -123
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 77, generator=g) * torch.rand(50, 1, generator=g) * 10
    q, scale = quantize_weight_per_channel(w)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    err = (q.float() * scale[:, None] - w).abs().amax(dim=1)
    assert bool((err <= scale / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_native_per_token_quantization_equals_torch(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 5
    x[0, :] = 0.0 if m > 1 else x[0, :]                   # a zero row (scale 0)
    xq, xs = quantized_ops.quantize_per_token_int8(x)
    want_q, want_s = quantize_activations_per_token(x)
    assert torch.equal(xs, want_s)
    assert torch.equal(xq, want_q)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_weight_only_matches_torch(m, n, k):
    g = torch.Generator().manual_seed(n * 100 + k)
    qweight, scale = quantize_weight_per_channel(torch.randn(n, k, generator=g))
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    want = _weight_only_reference(x, qweight, scale, bias)
    torch.testing.assert_close(quantized_ops.int8_linear(x, qweight, scale, bias), want,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quantized_ops.int8_linear(x, qweight, scale), want - bias,
                               rtol=1e-5, atol=1e-5)
    got = quantized_ops.int8_linear(x.bfloat16().view(m, 1, k), qweight, scale, bias)   # [..., K], bf16
    assert got.shape == (m, 1, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.view(m, n).float(),
                               _weight_only_reference(x.bfloat16().float(), qweight, scale, bias),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a8_matches_integer_reference(m, n, k):
    g = torch.Generator().manual_seed(n * 10 + k)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # -128 included
    qweight[0, :] = -128                                   # the sign trick's extreme
    scale = torch.rand(n, generator=g) / 100
    x, bias = torch.randn(m, k, generator=g) * 3, torch.randn(n, generator=g)
    x[:, 0] = 1000.0                                       # the max of each row: quants +-127
    got = quantized_ops.int8_linear(x, qweight, scale, bias, quantize_activations=True)
    torch.testing.assert_close(got, _w8a8_reference(x, qweight, scale, bias),
                               rtol=1e-6, atol=1e-6)


def test_w8a8_is_close_to_the_float_product():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 256, generator=g), torch.randn(4, 256, generator=g)
    qweight, scale = quantize_weight_per_channel(w)
    got = quantized_ops.int8_linear(x, qweight, scale, quantize_activations=True)
    want = x @ w.T
    assert float((got - want).norm() / want.norm()) < 2e-2


def test_errors():
    q, s = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="qweight"):
        quantized_ops.int8_linear(x, q.to(torch.uint8), s)
    with pytest.raises(ValueError, match="x"):
        quantized_ops.int8_linear(torch.randn(2, 9), q, s)
    with pytest.raises(ValueError, match="scale"):
        quantized_ops.int8_linear(x, q, torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        quantized_ops.int8_linear(x, q, s, torch.ones(5))
    with pytest.raises(ValueError, match="float32"):
        quantized_ops.quantize_per_token_int8(x.double())


@pytest.mark.slow
@pytest.mark.parametrize("m,n,k", [(1, 7, 13), (5, 33, 40), (13, 64, 100)])
def test_portable_build(monkeypatch, m, n, k):
    """The kernels built without AVX2/FMA (the scalar paths) against the same references."""
    monkeypatch.setattr(ops, "cpu_kernels", lambda: kernel_build("portable"))
    g = torch.Generator().manual_seed(k)
    qweight, scale = quantize_weight_per_channel(torch.randn(n, k, generator=g))
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(quantized_ops.int8_linear(x, qweight, scale, bias),
                               _weight_only_reference(x, qweight, scale, bias),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quantized_ops.int8_linear(x, qweight, scale, bias, True),
                               _w8a8_reference(x, qweight, scale, bias), rtol=1e-6, atol=1e-6)
