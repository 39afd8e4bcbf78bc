"""The native CPU linear kernel against torch's F.linear (fp32 and bf16 weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.ops import cpu_linear, cpu_linear_supported
from pagedllm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 33])
@pytest.mark.parametrize("n,k", [(1, 8), (7, 16), (130, 64), (96, 776)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(wdtype, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(wdtype)
    b = torch.randn(n, generator=g) if bias else None
    # a row-strided view of a wider tensor, as the fused QKV split produces
    x = torch.randn(m, k + 8, generator=g)[:, 4:4 + k]
    got = cpu_linear(x, w, b)
    want = F.linear(x, w.float(), b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [0, 1, 5])
def test_checked_float32_rows_equal_the_general_path(m):
    """`checked=True` with contiguous float32 rows and no bias (the rows path) gives the
    general path's result bit for bit, float32 whatever the default dtype."""
    g = torch.Generator().manual_seed(m + 1)
    w, x = torch.randn(17, 776, generator=g), torch.randn(m, 776, generator=g)
    general = cpu_linear(x, w)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        fast = cpu_linear(x, w, checked=True)
    finally:
        torch.set_default_dtype(before)
    assert fast.dtype == torch.float32 and fast.shape == (m, 17)
    assert torch.equal(fast, general)


@pytest.mark.parametrize("m", [1, 4, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_activations_in_and_out(m, bias):
    """bf16 x with a bf16 weight: the kernel reads and writes bf16 (fp32 math, rounded to
    nearest even), within one bf16 rounding of F.linear in fp32."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(2, m, 64, generator=g).bfloat16()
    b = torch.randn(40, generator=g) if bias else None
    got = cpu_linear(x, w, b)
    assert got.shape == (2, m, 40) and got.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)


def test_unsupported_shapes_are_refused():
    w = torch.randn(4, 12)                                   # K not a multiple of 8
    assert not cpu_linear_supported(torch.randn(2, 12), w)
    with pytest.raises(ValueError, match="does not support"):
        cpu_linear(torch.randn(2, 12), w)
    assert not cpu_linear_supported(torch.randn(2, 16), torch.randn(4, 16).half())


def test_platform_falls_back_to_torch():
    platform = CpuPlatform()
    w = torch.randn(4, 12)
    x = torch.randn(200, 12)
    torch.testing.assert_close(platform.linear(x, w), F.linear(x, w))
    x = torch.randn(2, 16)
    w = torch.randn(4, 16)
    torch.testing.assert_close(platform.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias_shape", [(4,), (32,), (3, 16)])
def test_bad_bias_is_refused(bias_shape):
    """A bias of the wrong shape must fail loudly, never read past its end."""
    with pytest.raises(ValueError, match="bias must be"):
        cpu_linear(torch.randn(3, 32), torch.randn(16, 32), torch.randn(*bias_shape))


def test_empty_and_scalar_inputs_are_refused():
    assert not cpu_linear_supported(torch.randn(3, 0), torch.randn(16, 0))
    assert not cpu_linear_supported(torch.tensor(1.0), torch.randn(16, 8))
