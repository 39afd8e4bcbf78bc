"""The kernels' portable code path (no AVX2/FMA), built as its own library and checked against
torch: what a CPU without AVX2 runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedllm.attention.backends.cpu_paged as cpu_paged
import pagedllm.native.kernels.attention_ops as attention_ops
import pagedllm.native.kernels.ops as ops
import pagedllm.native.fused_decoder as fused_decoder
from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.kernel_builds import kernel_build
from tests.attention import test_backends as backend_tests

# Slow: the portable library is a compile of its own (the default run compiles only the native one).
pytestmark = [pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def portable_lib():
    return kernel_build("portable")


@pytest.fixture
def use_portable(portable_lib, monkeypatch):
    monkeypatch.setattr(ops, "cpu_kernels", lambda: portable_lib)
    monkeypatch.setattr(attention_ops, "cpu_kernels", lambda: portable_lib)
    monkeypatch.setattr(cpu_paged, "cpu_kernels", lambda: portable_lib)
    monkeypatch.setattr(fused_decoder, "cpu_kernels", lambda: portable_lib)


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


def test_fused_decoder(use_portable, tiny_checkpoints):
    """The fused decoder layer built without AVX2 against HF, on a cached-prefix continuation."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM
    from tests.native.test_fused_decoder import _continuation_logits

    path = str(tiny_checkpoints["qwen3"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    tokens = torch.randint(3, hf.config.vocab_size, (45,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    got = _continuation_logits(llm, tokens, 29, fused=True)
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0, 29:]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_mla_expanded_rows_run_in_torch(use_portable):
    """A build without AVX-512 has no expanded MLA kernel: the backend runs those rows in
    torch (the absorbed rows in the portable paged kernel), equal to per-head attention."""
    from tests.attention.test_mla_cpu import _step, assert_expanded_rows_in_torch

    assert not attention_ops.mla_expanded_prefill_supported()
    assert_expanded_rows_in_torch(*_step(56, 4, "auto", torch.float32))
