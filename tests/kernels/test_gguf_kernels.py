"""The GGUF block kernels (`csrc/cpu_gguf_linear.cpp`, `ops.gguf_linear`) against
x @ dequantize(W)^T in float64, with `gguf`'s own dequantizer as the reference: every type with
a kernel (the K-quants included), the AVX2 build and the portable build (no AVX2/FMA/F16C),
batch 1 and > 1, output sizes off the register tiles, random block bytes (any scale, subnormal
halves included), weights split into row segments of mixed types, and clear errors for what
does not fit."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels import build_cpu_kernels, cpu_kernels
from pagedllm.kernels.ops import GGUF_KERNEL_TYPES, gguf_linear, gguf_linear_segments
from pagedllm.model_loader.gguf import dequantize
from tests.fixtures.gguf_files import quantize

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

TYPES = list(GGUF_KERNEL_TYPES)
# (M, N, K): batch 1 and more, N off the 4-row GEMV and 2-row GEMM tiles, 1..8 blocks per row.
SHAPES = [(1, 1, 32), (1, 37, 64), (2, 5, 96), (5, 19, 128), (9, 66, 256)]
# The K-quants' 256-weight blocks: 1 and 2 blocks per row.
K_SHAPES = [(1, 1, 256), (1, 37, 512), (2, 5, 256), (5, 19, 512), (9, 66, 256)]
# Byte offsets of each type's fp16 scales inside a block (the rest are quants / packed scales).
_HALF_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _shapes(tensor_type: str) -> list[tuple[int, int, int]]:
    return K_SHAPES if GGUF_KERNEL_TYPES[tensor_type].block_weights == 256 else SHAPES


def _random_blocks(tensor_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, k / block_weights * block_bytes] uint8 of random quants and packed scales, and finite
    random half scales (the exponent range of real files and beyond, subnormals included)."""
    rng = np.random.default_rng(seed)
    _, block_weights, block_bytes = GGUF_KERNEL_TYPES[tensor_type]
    blocks = rng.integers(0, 256, size=(n, k // block_weights, block_bytes), dtype=np.uint8)
    for offset in _HALF_OFFSETS[tensor_type]:
        halves = rng.standard_normal((n, k // block_weights)) * np.exp2(
            rng.integers(-26, 2, size=(n, k // block_weights)))
        blocks[..., offset:offset + 2] = halves.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def _reference(x: torch.Tensor, blocks: np.ndarray, tensor_type: str,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T + bias in float64, |x| @ |W|^T: the scale of the summation error)."""
    w = torch.from_numpy(dequantize(blocks, tensor_type)).double()
    y = x.double() @ w.T + (0 if bias is None else bias.double())
    return y, x.double().abs() @ w.abs().T


def _assert_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    bound = 1e-5 * scale + 1e-30
    assert torch.all(err <= bound), (f"max error {err.max():.3g}, "
                                     f"{(err / bound).max():.3g}x the bound")


def _call(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, tensor_type: str,
          bias: torch.Tensor | None) -> torch.Tensor:
    """The library's `linear_gguf_f32` on float32 x [M, K] (any library build)."""
    code = GGUF_KERNEL_TYPES[tensor_type].code
    y = torch.empty(x.shape[0], blocks.shape[0])
    rc = lib.linear_gguf_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
                             blocks.data_ptr(), blocks.shape[0], code,
                             None if bias is None else bias.data_ptr(), y.data_ptr(), y.shape[1])
    assert rc == 0
    return y


@pytest.fixture(scope="module")
def portable_lib():
    return build_cpu_kernels(("-mno-avx2", "-mno-fma", "-mno-f16c"))


@pytest.mark.parametrize("tensor_type", TYPES)
def test_matches_dequantized_reference(tensor_type):
    for m, n, k in _shapes(tensor_type):
        g = torch.Generator().manual_seed(m * 1000 + n)
        w = torch.randn(n, k, generator=g).numpy()
        blocks = quantize(w, tensor_type)
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(n, generator=g)
        want, scale = _reference(x, blocks, tensor_type, bias)
        got = gguf_linear(x, torch.from_numpy(blocks.copy()), tensor_type, bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        _assert_close(got, want, scale)


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("tensor_type", TYPES)
def test_random_block_bytes_both_builds(build, tensor_type, portable_lib):
    lib = cpu_kernels() if build == "native" else portable_lib
    for seed, (m, n, k) in enumerate(_shapes(tensor_type)):
        blocks = _random_blocks(tensor_type, n, k, seed)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
        want, scale = _reference(x, blocks, tensor_type, None)
        _assert_close(_call(lib, x, torch.from_numpy(blocks), tensor_type, None), want, scale)


def test_leading_dims_strided_and_low_precision_activations():
    blocks = gguf.quants.quantize(torch.randn(24, 64).numpy(), gguf.GGMLQuantizationType.Q4_0)
    qweight = torch.from_numpy(blocks.copy())
    x = torch.randn(2, 3, 128)[..., :64]        # [2, 3, 64] with row stride 128
    want, scale = _reference(x.reshape(-1, 64), blocks, "Q4_0", None)
    _assert_close(gguf_linear(x, qweight, "Q4_0").reshape(-1, 24), want, scale)
    xb = x.bfloat16()
    got = gguf_linear(xb, qweight, "Q4_0")
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 24)
    want_b, _ = _reference(xb.float().reshape(-1, 64), blocks, "Q4_0", None)
    torch.testing.assert_close(got.float().reshape(-1, 24), want_b.float(), rtol=1e-2, atol=1e-2)


def test_bad_operands_are_named():
    qweight = torch.zeros(4, 2 * 18, dtype=torch.uint8)      # Q4_0, K = 64
    with pytest.raises(ValueError, match="Q2_K"):
        gguf_linear(torch.randn(1, 64), qweight, "Q2_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_linear(torch.randn(1, 64), qweight, "Q4_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_linear(torch.randn(1, 48), torch.zeros(4, 27, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="does not fit"):
        gguf_linear(torch.randn(1, 64), qweight, "Q8_0")     # 36 bytes per row, not 68
    with pytest.raises(ValueError, match="bias"):
        gguf_linear(torch.randn(1, 64), qweight, "Q4_0", torch.zeros(5))


def _q8_activation_reference(x: torch.Tensor, blocks: np.ndarray, tensor_type: str):
    """llama.cpp's Q8_0 activation rounding (scale = block max / 127, round half away from
    zero) followed by exact dot products: (y, the scale of the summation error), float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    v = xb * inv
    xq = (torch.sign(v) * torch.floor(v.abs() + 0.5)).double() * d.double()
    w = torch.from_numpy(dequantize(blocks, tensor_type)).double()
    xq = xq.reshape(m, k)
    return xq @ w.T, xq.abs() @ w.abs().T


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_8bit_activation_variant(build, tensor_type, portable_lib):
    lib = cpu_kernels() if build == "native" else portable_lib
    code = GGUF_KERNEL_TYPES[tensor_type].code
    for seed, (m, n, k) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(seed)
        blocks = gguf.quants.quantize(torch.randn(n, k, generator=g).numpy(),
                                      gguf.GGMLQuantizationType[tensor_type])
        x = torch.randn(m, k, generator=g)
        want, scale = _q8_activation_reference(x, blocks, tensor_type)
        y = torch.empty(m, n)
        qweight = torch.from_numpy(blocks.copy())
        assert lib.linear_gguf_q8_activations(x.data_ptr(), k, m, k, qweight.data_ptr(), n,
                                              code, None, y.data_ptr(), n) == 0
        _assert_close(y, want, scale)
        if build == "native":
            _assert_close(gguf_linear(x, qweight, tensor_type, quantize_activations=True),
                          want, scale)
    with pytest.raises(ValueError, match="8-bit activations"):
        gguf_linear(torch.randn(1, 32), torch.zeros(1, 20, dtype=torch.uint8), "Q4_1",
                    quantize_activations=True)


@pytest.mark.parametrize("build", ["native", "portable"])
def test_row_segments_of_mixed_types(build, portable_lib):
    """A qkv-like weight: Q4_K rows, then Q6_K rows, then Q8_0 rows, in one call (segments
    given out of order), with a bias and M off the 4-row kernel."""
    g = torch.Generator().manual_seed(7)
    k, sizes, types = 512, (40, 12, 9), ("Q4_K", "Q6_K", "Q8_0")
    parts, starts = [], np.cumsum((0,) + sizes[:-1])
    for start, rows, tensor_type in zip(starts, sizes, types):
        parts.append((int(start), tensor_type,
                      torch.from_numpy(quantize(torch.randn(rows, k, generator=g).numpy(),
                                                tensor_type))))
    x, bias = torch.randn(6, k, generator=g), torch.randn(sum(sizes), generator=g)
    w = torch.cat([torch.from_numpy(dequantize(q.numpy(), t)) for _, t, q in parts]).double()
    want, scale = x.double() @ w.T + bias.double(), x.double().abs() @ w.abs().T
    if build == "native":
        got = gguf_linear_segments(x, parts[::-1], sum(sizes), bias)
    else:
        from pagedllm.kernels.ops import gguf_segment_structs
        structs = gguf_segment_structs(parts, k)
        got = torch.empty(6, sum(sizes))
        assert portable_lib.linear_gguf_segments(x.data_ptr(), k, 6, k, structs, len(structs),
                                                 bias.data_ptr(), got.data_ptr(),
                                                 sum(sizes)) == 0
    _assert_close(got, want, scale)
    with pytest.raises(ValueError, match="cover"):
        gguf_linear_segments(x, parts[:2], sum(sizes))


@pytest.mark.parametrize("build", ["native", "portable"])
def test_dequantize_rows_for_embedding_lookups(build, portable_lib):
    from pagedllm.kernels.ops import gguf_dequantize_rows
    lib = cpu_kernels() if build == "native" else portable_lib
    ids = torch.tensor([[2, 0], [5, 2]])
    for seed, tensor_type in enumerate(TYPES):
        k = GGUF_KERNEL_TYPES[tensor_type].block_weights * 2
        blocks = _random_blocks(tensor_type, 6, k, seed)
        want = torch.from_numpy(dequantize(blocks, tensor_type))[ids]
        qweight = torch.from_numpy(blocks)
        if build == "native":
            got = gguf_dequantize_rows(qweight, tensor_type, ids, k)
        else:
            flat = ids.reshape(-1).contiguous()
            got = torch.empty(4, k)
            assert lib.dequantize_rows_gguf(qweight.data_ptr(), k,
                                            GGUF_KERNEL_TYPES[tensor_type].code,
                                            flat.data_ptr(), 4, got.data_ptr()) == 0
            got = got.view(2, 2, k)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError, match="outside"):
        gguf_dequantize_rows(torch.zeros(2, 18, dtype=torch.uint8), "Q4_0", torch.tensor([2]), 32)
