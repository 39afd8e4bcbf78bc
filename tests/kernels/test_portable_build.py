"""The kernels' portable code path (no AVX2/FMA), built as its own library and checked against
torch: what a CPU without AVX2 runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedllm.attention.backends.cpu_paged as cpu_paged
import pagedllm.kernels.ops as ops
from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.kernels import build_cpu_kernels, cpu_kernels
from tests.attention import test_backends as backend_tests

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")


@pytest.fixture(scope="module")
def portable_lib():
    return build_cpu_kernels(("-mno-avx2", "-mno-fma"))


@pytest.fixture
def use_portable(portable_lib, monkeypatch):
    monkeypatch.setattr(ops, "cpu_kernels", lambda: portable_lib)
    monkeypatch.setattr(cpu_paged, "cpu_kernels", lambda: portable_lib)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 7, 12), (5, 33, 40), (13, 64, 96)])
def test_linear(use_portable, wdtype, m, n, k):
    w = torch.randn(n, k).to(wdtype)
    x = torch.randn(m, k)
    b = torch.randn(n)
    if k % 8:   # the portable path has no K % 8 restriction, but the Python entry keeps it
        with pytest.raises(ValueError):
            ops.cpu_linear(x, w, b)
        return
    torch.testing.assert_close(ops.cpu_linear(x, w, b), F.linear(x, w.float(), b),
                               atol=1e-4, rtol=1e-4)
    if wdtype == torch.bfloat16:                       # bf16 activations in and out
        got = ops.cpu_linear(x.bfloat16(), w, b)
        torch.testing.assert_close(got.float(), F.linear(x.bfloat16().float(), w.float(), b),
                                   atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("shape", backend_tests.SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_reqs", [1, 6])
def test_attention(use_portable, shape, dtype, num_reqs):
    backend_tests.test_matches_dense(CpuPagedBackend, shape, dtype, num_reqs, seed=0)
