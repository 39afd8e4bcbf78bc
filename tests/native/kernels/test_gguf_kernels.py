"""The GGUF block kernels (`csrc/cpu_gguf_linear.cpp`, `ops.gguf_linear`) against
x @ dequantize(W)^T in float64, with `gguf`'s own dequantizer as the reference: every type with
a kernel (the K-quants included), the AVX2 build and the portable build (no AVX2/FMA/F16C),
batch 1 and > 1, output sizes off the register tiles, random block bytes (any scale, subnormal
halves included), weights split into row segments of mixed types, and clear errors for what
does not fit. The 8-bit-activation kernels (`csrc/gguf_q8_dot.h`) the same way, in their VNNI,
AVX2 and portable builds, against x rounded as they document (and against float32 x within the
rounding bound)."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.kernel_builds import BUILD_FLAGS, BUILD_PARAMS, kernel_build
from pagedllm.native.kernels.quantized_ops import (GGUF_GROUP_ROWS, GGUF_KERNEL_TYPES, gguf_group_rows,
                                         gguf_linear, gguf_linear_segments, gguf_segment_structs,
                                         gguf_ungroup_rows)
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
          bias: torch.Tensor | None, grouped: bool = False) -> torch.Tensor:
    """The library's `linear_gguf_segments` on float32 x [M, K] (any library build), the
    weight's plain rows put in the row-group layout first if `grouped`."""
    if grouped:
        blocks = gguf_group_rows(blocks, tensor_type)
    structs = gguf_segment_structs([(0, tensor_type, blocks, grouped)], x.shape[1])
    y = torch.empty(x.shape[0], blocks.shape[0])
    rc = lib.linear_gguf_segments(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], structs,
                                  1, None if bias is None else bias.data_ptr(), y.data_ptr(),
                                  y.shape[1])
    assert rc == 0
    return y




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


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
@pytest.mark.parametrize("build", [b for b in BUILD_PARAMS if b != "avx2"])
@pytest.mark.parametrize("tensor_type", TYPES)
def test_random_block_bytes_both_builds(build, tensor_type, grouped):
    lib = kernel_build(build)
    for seed, (m, n, k) in enumerate(_shapes(tensor_type)):
        blocks = _random_blocks(tensor_type, n, k, seed)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
        want, scale = _reference(x, blocks, tensor_type, None)
        _assert_close(_call(lib, x, torch.from_numpy(blocks), tensor_type, None, grouped),
                      want, scale)


# Lane-group layouts (csrc/gguf_blocks.h LaneGroup): the scale bytes before the quants of a
# block; a type not listed keeps whole blocks.
LANE_SCALE_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4, "Q4_K": 16, "Q5_K": 16}


@pytest.mark.parametrize("tensor_type", list(GGUF_KERNEL_TYPES))
def test_row_group_layout(tensor_type):
    """`gguf_group_rows` against the layout's definition (csrc/gguf_blocks.h), rows past the
    last whole group plain, and `gguf_ungroup_rows` inverting it. Q5_0 / Q5_1 / Q6_K: block b
    of row 4 g + j at byte (4 (g nb + b) + j) * block_bytes. The others (lane groups): the
    record of group g, block b at 4 (g nb + b) block_bytes holds the scale bytes in 2-byte
    units, unit u of row j at 8 u + 2 j (d; Q4_1's m; the K-quants' dmin and packed scales),
    then quant byte q of row j at 32 (k / 2) + 16 (k % 2) + 4 j + q % 4, k = q / 4."""
    block_bytes = GGUF_KERNEL_TYPES[tensor_type].block_bytes
    scale_bytes = LANE_SCALE_BYTES.get(tensor_type)
    nb, rows = 3, 2 * GGUF_GROUP_ROWS + 3
    plain = torch.from_numpy(_random_blocks(tensor_type, rows, nb * GGUF_KERNEL_TYPES[
        tensor_type].block_weights, 0))
    grouped = gguf_group_rows(plain, tensor_type)
    assert grouped.shape == plain.shape and not torch.equal(grouped, plain)
    flat = grouped.reshape(-1)
    for n in range(rows):
        for b in range(nb):
            want = plain[n, b * block_bytes:(b + 1) * block_bytes]
            if n >= 2 * GGUF_GROUP_ROWS:
                at = (n * nb + b) * block_bytes
                assert torch.equal(flat[at:at + block_bytes], want)
                continue
            g, j = divmod(n, GGUF_GROUP_ROWS)
            if scale_bytes is None:
                at = (GGUF_GROUP_ROWS * (g * nb + b) + j) * block_bytes
                assert torch.equal(flat[at:at + block_bytes], want)
                continue
            record = GGUF_GROUP_ROWS * (g * nb + b) * block_bytes
            for o in range(scale_bytes):
                assert flat[record + 2 * GGUF_GROUP_ROWS * (o // 2) + 2 * j + o % 2] == want[o]
            quants = record + GGUF_GROUP_ROWS * scale_bytes
            for q in range(block_bytes - scale_bytes):
                k = q // 4
                at = quants + 32 * (k // 2) + 16 * (k % 2) + 4 * j + q % 4
                assert flat[at] == want[scale_bytes + q]
    assert torch.equal(gguf_ungroup_rows(grouped, tensor_type), plain)
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_group_rows(plain[:, :-1].contiguous(), tensor_type)
    with pytest.raises(ValueError, match="uint8"):
        gguf_group_rows(plain.float(), tensor_type)


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


# --- 8-bit activations (csrc/gguf_q8_dot.h): each build's integer path against x rounded the
# same way (tight: only the float summation order differs) and against float32 x (the rounding
# error bound).

# (M, N, K): batch 1, M off the 4-row kernel and a batched-decode size, N off the 4- and 2-row
# weight tiles; in 256-weight blocks for every type.
Q8_SHAPES = [(1, 1, 256), (1, 37, 512), (3, 5, 256), (6, 19, 512), (32, 9, 256)]




def _round_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rounded as gguf_q8_dot.h documents it, [M, K] float32; the per-element block scale
    d [M, K]): d = block max / 127, q = round(x * (1 / d)) half to even, in float32; blocks of
    32 values, or 256 for the K-quants (`_activation_block`)."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)
    return (q * d).reshape(m, k), d.expand(-1, -1, block).reshape(m, k)


def _activation_block(tensor_type: str) -> int:
    """The values per activation scale the 8-bit kernels of a type read: 256 for K-quants."""
    return 256 if GGUF_KERNEL_TYPES[tensor_type].block_weights == 256 else 32


def _q8_call(lib, x: torch.Tensor, parts, n: int, bias: torch.Tensor | None = None):
    structs = gguf_segment_structs(parts, x.shape[1])
    y = torch.empty(x.shape[0], n)
    assert lib.linear_gguf_segments_q8(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
                                       structs, len(structs),
                                       None if bias is None else bias.data_ptr(), y.data_ptr(),
                                       n) == 0
    return y


@pytest.mark.slow   # builds the portable (and, with AVX-512, the AVX2) library
def test_q8_builds_take_their_integer_paths():
    q8_libs = {name: kernel_build(name) for name in BUILD_FLAGS}
    vnni = "avx512_vnni" in open("/proc/cpuinfo").read()
    assert q8_libs["portable"].gguf_q8_dot_isa() == 0
    if "avx2" in open("/proc/cpuinfo").read():
        assert q8_libs["avx2"].gguf_q8_dot_isa() == 1
        assert q8_libs["native"].gguf_q8_dot_isa() == (2 if vnni else 1)


@pytest.mark.parametrize("build", BUILD_PARAMS)
def test_activation_rounding_is_exact(build):
    from pagedllm.native.kernels.quantized_ops import gguf_quantize_activations
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0]).repeat_interleave(
        32)
    x[1, :32] = torch.arange(32) - 15.5      # x * (1 / d) lands on halves: ties to even
    q, d, ds = gguf_quantize_activations(x, kernel_build(build))
    xb = x.reshape(5, 4, 32)
    want_d = xb.abs().amax(-1) / 127
    inv = torch.where(want_d != 0, 1 / want_d, torch.zeros_like(want_d))
    want_q = torch.round(xb * inv[..., None]).to(torch.int8).reshape(5, 128)
    assert torch.equal(d, want_d) and torch.equal(q, want_q)
    assert int(q.abs().max()) == 127 and torch.all(q[:, 96:] == 0) and torch.all(d[:, 3] == 0)
    torch.testing.assert_close(ds, d * q.reshape(5, 4, 32).sum(-1).float(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_quantize_activations(torch.randn(2, 48))


@pytest.mark.parametrize("build", BUILD_PARAMS)
def test_k_activation_rounding_is_exact(build):
    """The K-quants' 256-value blocks: one scale per block, int16 sums per 16 values."""
    from pagedllm.native.kernels.quantized_ops import gguf_quantize_activations
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 768, generator=g) * torch.tensor([1e-3, 30.0, 0.0]).repeat_interleave(256)
    x[1, :32] = torch.arange(32) - 15.5      # ties to even again
    x[1, :32] *= x[1, 256:512].abs().max() / 127
    q, d, bsums = gguf_quantize_activations(x, kernel_build(build), block=256)
    xb = x.reshape(3, 3, 256)
    want_d = xb.abs().amax(-1) / 127
    inv = torch.where(want_d != 0, 1 / want_d, torch.zeros_like(want_d))
    want_q = torch.round(xb * inv[..., None]).to(torch.int8).reshape(3, 768)
    assert torch.equal(d, want_d) and torch.equal(q, want_q)
    assert bsums.dtype == torch.int16 and torch.all(d[:, 2] == 0)
    assert torch.equal(bsums, q.reshape(3, 48, 16).sum(-1, dtype=torch.int16))
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_quantize_activations(torch.randn(2, 288), block=256)


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
@pytest.mark.parametrize("build", BUILD_PARAMS)
@pytest.mark.parametrize("tensor_type", TYPES)
def test_q8_activations_match_the_rounded_reference(build, tensor_type, grouped):
    for seed, (m, n, k) in enumerate(Q8_SHAPES):
        blocks = _random_blocks(tensor_type, n, k, seed)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k // 32, 1, generator=g)
                                                       ).expand(-1, -1, 32).reshape(m, k)
        bias = torch.randn(n, generator=g) if seed % 2 else None
        x_q, d = _round_activations(x, _activation_block(tensor_type))
        want, scale = _reference(x_q, blocks, tensor_type, bias)
        qweight = torch.from_numpy(blocks)
        if grouped:
            qweight = gguf_group_rows(qweight, tensor_type)
        got = _q8_call(kernel_build(build), x, [(0, tensor_type, qweight, grouped)], n, bias)
        _assert_close(got, want, scale)
        # Against float32 x: within the rounding error (|x - x_q| <= d / 2 per element).
        want_f, scale_f = _reference(x, blocks, tensor_type, bias)
        w_abs = torch.from_numpy(dequantize(blocks, tensor_type)).double().abs()
        bound = (d.double() / 2) @ w_abs.T + 1e-5 * scale_f + 1e-30
        assert torch.all((got.double() - want_f).abs() <= bound)


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
@pytest.mark.parametrize("build", BUILD_PARAMS)
@pytest.mark.parametrize("tensor_type", TYPES)
def test_q8_small_batches_equal_single_rows(build, tensor_type, grouped):
    """Verification-sized batches (1 + drafts rows of a speculative step): M = 1..17 rows in
    one call, which the kernels cover in row passes of up to 8 rows (lane groups) or 4 (the
    row-per-pair kernels), balanced up to 16 rows and passes of 4 plus a tail beyond, equal
    bitwise the rows computed one at a time (each row's float sums run in the same order in
    every pass size), and those match the rounded reference. 9 weight rows: two lane groups
    and a plain tail row when grouped; a bias."""
    lib = kernel_build(build)
    n, k, rows = 9, 512, 17
    blocks = _random_blocks(tensor_type, n, k, 5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, k // 32, 1, generator=g)
                                                      ).expand(-1, -1, 32).reshape(rows, k)
    bias = torch.randn(n, generator=g)
    qweight = torch.from_numpy(blocks)
    if grouped:
        qweight = gguf_group_rows(qweight, tensor_type)
    parts = [(0, tensor_type, qweight, grouped)]
    single = torch.cat([_q8_call(lib, x[i:i + 1], parts, n, bias) for i in range(rows)])
    x_q, _ = _round_activations(x, _activation_block(tensor_type))
    want, scale = _reference(x_q, blocks, tensor_type, bias)
    _assert_close(single, want, scale)
    for m in range(2, rows + 1):
        got = _q8_call(lib, x[:m], parts, n, bias)
        assert torch.equal(got, single[:m]), f"M = {m}"


@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q4_K", "Q6_K"])
def test_q8_activations_of_real_quantized_weights_stay_close(tensor_type):
    """Weights quantized from N(0, 1) and float32 x through `gguf_linear`: the 8-bit rounding
    moves outputs by about 1e-3 of their scale, bf16-like, far below the weights' own error."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 512, generator=g)
    qweight = torch.from_numpy(quantize(w.numpy(), tensor_type))
    x = torch.randn(2, 3, 512, generator=g)
    got = gguf_linear(x, qweight, tensor_type, quantize_activations=True)
    assert got.shape == (2, 3, 64)
    want, scale = _reference(x.reshape(6, 512), qweight.numpy(), tensor_type, None)
    rel = ((got.reshape(6, 64).double() - want).abs() / scale).max()
    assert 1e-5 < rel < 5e-3
    exact = gguf_linear(x, qweight, tensor_type)
    assert not torch.equal(got, exact)


@pytest.mark.parametrize("build", [b for b in BUILD_PARAMS if b != "avx2"])
def test_row_segments_of_mixed_types(build):
    """A qkv-like weight: Q4_K rows, then Q6_K rows, then Q8_0 rows, in one call (segments
    given out of order), with a bias and M off the 4-row kernel; the same in the row-group
    layout (9 rows: two groups and a plain row)."""
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
    grouped_parts = [(r, t, gguf_group_rows(q, t), True) for r, t, q in parts]
    for layout in (parts, grouped_parts):
        if build == "native":
            got = gguf_linear_segments(x, layout[::-1], sum(sizes), bias)
        else:
            structs = gguf_segment_structs(layout, k)
            got = torch.empty(6, sum(sizes))
            assert kernel_build(build).linear_gguf_segments(x.data_ptr(), k, 6, k, structs,
                                                     len(structs), bias.data_ptr(),
                                                     got.data_ptr(), sum(sizes)) == 0
        _assert_close(got, want, scale)
    with pytest.raises(ValueError, match="cover"):
        gguf_linear_segments(x, parts[:2], sum(sizes))


@pytest.mark.parametrize("build", BUILD_PARAMS)
def test_q8_activations_on_row_segments_of_mixed_types(build):
    """The fused-qkv case of a Q4_K_M file on 8-bit activations, with 32-value types mixed in:
    x is rounded once per block family for all segments (Q4_K, Q6_K, Q4_1 and Q5_0 rows; out
    of order), M = 1 and M off the 4-row kernel."""
    g = torch.Generator().manual_seed(8)
    k, sizes, types = 512, (40, 12, 9, 3), ("Q4_K", "Q6_K", "Q4_1", "Q5_0")
    parts, starts = [], np.cumsum((0,) + sizes[:-1])
    for start, rows, tensor_type in zip(starts, sizes, types):
        parts.append((int(start), tensor_type,
                      torch.from_numpy(quantize(torch.randn(rows, k, generator=g).numpy(),
                                                tensor_type))))
    bias = torch.randn(sum(sizes), generator=g)
    grouped_parts = [(r, t, gguf_group_rows(q, t), True) for r, t, q in parts]
    for m in (1, 7):
        x = torch.randn(m, k, generator=g)
        # Each segment against x rounded in its own family's blocks.
        want, scale = [], []
        for _, tensor_type, qweight in parts:
            x_q, _ = _round_activations(x, _activation_block(tensor_type))
            w = torch.from_numpy(dequantize(qweight.numpy(), tensor_type)).double()
            want.append(x_q.double() @ w.T)
            scale.append(x_q.double().abs() @ w.abs().T)
        want, scale = torch.cat(want, 1) + bias.double(), torch.cat(scale, 1)
        _assert_close(_q8_call(kernel_build(build), x, parts[::-1], sum(sizes), bias), want, scale)
        _assert_close(_q8_call(kernel_build(build), x, grouped_parts, sum(sizes), bias), want, scale)
        if build == "native":
            _assert_close(gguf_linear_segments(x, parts, sum(sizes), bias,
                                               quantize_activations=True), want, scale)


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
@pytest.mark.parametrize("build", [b for b in BUILD_PARAMS if b != "avx2"])
def test_dequantize_rows_for_embedding_lookups(build, grouped):
    """Rows 0, 2 (in the first row group when grouped) and 5 (a plain tail row of 6)."""
    from pagedllm.native.kernels.quantized_ops import gguf_dequantize_rows
    lib = kernel_build(build)
    ids = torch.tensor([[2, 0], [5, 2]])
    for seed, tensor_type in enumerate(TYPES):
        k = GGUF_KERNEL_TYPES[tensor_type].block_weights * 2
        blocks = _random_blocks(tensor_type, 6, k, seed)
        want = torch.from_numpy(dequantize(blocks, tensor_type))[ids]
        qweight = torch.from_numpy(blocks)
        if grouped:
            qweight = gguf_group_rows(qweight, tensor_type)
        if build == "native":
            got = gguf_dequantize_rows(qweight, tensor_type, ids, k, grouped)
        else:
            flat = ids.reshape(-1).contiguous()
            got = torch.empty(4, k)
            structs = gguf_segment_structs([(0, tensor_type, qweight, grouped)], k)
            assert lib.dequantize_rows_gguf(structs, k, flat.data_ptr(), 4, got.data_ptr()) == 0
            got = got.view(2, 2, k)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    for bad in ([2], [0, -1]):
        with pytest.raises(ValueError, match=r"ids outside \[0, 2\)"):
            gguf_dequantize_rows(torch.zeros(2, 18, dtype=torch.uint8), "Q4_0",
                                 torch.tensor(bad), 32)
