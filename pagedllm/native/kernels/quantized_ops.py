"""Python entry points of the native CPU kernels on quantized weights: GGUF block formats kept
quantized (`csrc/gguf_*.cpp`) and int8 weights with per-channel scales."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.native.kernels.ops import require_kernels

class GGUFBlockType(NamedTuple):
    """A GGML block format: `code` (ggml.h's enum ggml_type), `block_weights` (weights per
    block along a row), `block_bytes` (bytes per block)."""

    code: int
    block_weights: int
    block_bytes: int


# GGML block types `gguf_linear` computes on, by name (llama.cpp's ggml-common.h).
GGUF_KERNEL_TYPES = {
    "Q8_0": GGUFBlockType(8, 32, 34), "Q4_0": GGUFBlockType(2, 32, 18),
    "Q4_1": GGUFBlockType(3, 32, 20), "Q5_0": GGUFBlockType(6, 32, 22),
    "Q5_1": GGUFBlockType(7, 32, 24), "Q4_K": GGUFBlockType(12, 256, 144),
    "Q5_K": GGUFBlockType(13, 256, 176), "Q6_K": GGUFBlockType(14, 256, 210)}
GGUF_BLOCK_SIZE = 32  # the smallest block: an input split must fall on its multiples at least


GGUF_GROUP_ROWS = 4  # rows per group of the row-group layout (csrc/gguf_blocks.h kGroupRows)


# Rows [row_start, row_start + rows) of a weight, stored at `data` as rows * row_bytes bytes of
# blocks of type `ggml_type`, plain rows or (`grouped` 1) in the row-group layout
# (`gguf_group_rows`).
GGUFSegmentStruct = abi.struct("GGUFSegment")


def gguf_group_rows(qweight: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """A GGUF weight's plain rows in the row-group layout of the block kernels
    (csrc/gguf_blocks.h, after llama.cpp's load-time repacking): each group of GGUF_GROUP_ROWS
    consecutive rows stores block 0 of its rows, then block 1, and so on (Q8_0, Q4_0, Q4_1,
    Q4_K, Q5_K: each such block set as one record whose quant bytes alternate between the rows every
    4 bytes), so a kernel reading a group's rows side by side reads memory sequentially; the last
    rows % GGUF_GROUP_ROWS rows stay plain. The bytes are the same, reordered.

    Args:
        qweight: [rows, row_bytes] uint8 plain rows of `tensor_type` blocks.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES.

    Returns:
        A new [rows, row_bytes] uint8 tensor (row n's bytes are no longer row n of it).

    Raises:
        ValueError: not a [rows, row_bytes] uint8 CPU tensor, or a type without kernels.
        RuntimeError: the native kernels are unavailable.
    """
    return _permute_groups(qweight, tensor_type, inverse=False)


def gguf_ungroup_rows(qweight: torch.Tensor, tensor_type: str) -> torch.Tensor:
    """The inverse of `gguf_group_rows` (same arguments and errors): [rows, row_bytes] uint8 in
    the row-group layout -> a new tensor of the plain rows."""
    return _permute_groups(qweight, tensor_type, inverse=True)


def _permute_groups(qweight: torch.Tensor, tensor_type: str, inverse: bool) -> torch.Tensor:
    """`gguf_group_rows` (or its inverse) natively (`gguf_regroup_rows`,
    csrc/cpu_gguf_linear.cpp): several times faster than torch's byte-strided copies
    (docs/benchmarks.md, "Measurements behind choices in the code")."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.device.type != "cpu":
        raise ValueError(f"gguf_group_rows: a [rows, row_bytes] uint8 CPU tensor is needed, got "
                         f"{tuple(qweight.shape)} {qweight.dtype} on {qweight.device}")
    rows, row_bytes = qweight.shape
    block = GGUF_KERNEL_TYPES.get(tensor_type)
    if block is None or row_bytes % block.block_bytes:
        raise ValueError(f"gguf_group_rows: {tensor_type} rows of {row_bytes} bytes are not "
                         f"whole blocks of a kernel type ({', '.join(GGUF_KERNEL_TYPES)})")
    lib = require_kernels(None, "gguf_group_rows")
    src = qweight.contiguous()
    out = src.clone()                # the rows past the last whole group stay plain
    lib.gguf_regroup_rows(src.data_ptr(), out.data_ptr(), rows, row_bytes, block.code,
                          int(inverse))
    return out


def gguf_segment_structs(segments: Sequence[tuple], k: int) -> ctypes.Array:
    """The native description of a weight's row segments, checked against input size `k`.

    Args:
        segments: (row_start, GGML type name, qweight [rows, k / block_weights * block_bytes]
            uint8 contiguous CPU tensor[, grouped]) per segment, `grouped` (default False)
            telling that qweight is in the row-group layout (`gguf_group_rows`); the caller
            keeps the tensors alive while the structures are in use.
        k: the input size (a multiple of each type's block_weights).

    Raises:
        ValueError: an unsupported type, or a qweight / k that does not fit it (naming both).
    """
    structs = (GGUFSegmentStruct * len(segments))()
    for struct, (row_start, tensor_type, qweight, *grouped) in zip(structs, segments):
        if tensor_type not in GGUF_KERNEL_TYPES:
            raise ValueError(f"gguf_linear: tensor type {tensor_type} not supported; supported: "
                             f"{', '.join(GGUF_KERNEL_TYPES)}")
        code, block_weights, block_bytes = GGUF_KERNEL_TYPES[tensor_type]
        if (qweight.device.type != "cpu" or qweight.dtype != torch.uint8 or qweight.dim() != 2
                or not qweight.is_contiguous() or k % block_weights
                or qweight.shape[1] != k // block_weights * block_bytes):
            raise ValueError(
                f"gguf_linear: an input size of {k} does not fit the {tensor_type} weight "
                f"{tuple(qweight.shape)} {qweight.dtype} on {qweight.device} (needs a "
                f"contiguous uint8 CPU weight of K / {block_weights} * {block_bytes} bytes per "
                f"row, K a multiple of {block_weights})")
        struct.data, struct.row_start = qweight.data_ptr(), row_start
        struct.rows, struct.ggml_type = qweight.shape[0], code
        struct.grouped = int(bool(grouped and grouped[0]))
    return structs


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, tensor_type: str,
                bias: torch.Tensor | None = None, quantize_activations: bool = False,
                grouped: bool = False) -> torch.Tensor:
    """y = x @ dequantize(qweight)^T + bias with the weight kept in its GGML block format; each
    block is unpacked in registers inside the dot product (`csrc/cpu_gguf_linear.cpp`, as in
    llama.cpp's ggml), activations and sums in float32.

    Args:
        x: [..., K] float32/bfloat16/float16 on the CPU (computed in float32); K a multiple of
            the type's block_weights (32, or 256 for the K-quants).
        qweight: [N, K / block_weights * block_bytes] uint8, contiguous: each row its
            consecutive blocks, as a GGUF file stores them.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES ("Q8_0", "Q4_K", ...).
        bias: [N] on the CPU, or None.
        quantize_activations: first round x to 8 bits per 32-value block, or per 256 for the
            K-quants (see `gguf_quantize_activations`), and compute integer dot products per
            block (`csrc/gguf_q8_dot.h`, llama.cpp's `ggml_vec_dot_<type>_q8_0` / `_q8_K`
            schemes): equal to x_q @ dequantize(W)^T, x_q the rounded x, up to the order of the
            float32 sums; every type in GGUF_KERNEL_TYPES. The layers' choice:
            `GGUFLinearMethod`.
        grouped: qweight is in the row-group layout (`gguf_group_rows`).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: an unsupported type, shapes or dtypes that do not fit, non-CPU tensors.
        RuntimeError: the native kernels are unavailable (see `pagedllm.native.kernels.cpu_kernels`).
    """
    return gguf_linear_segments(x, [(0, tensor_type, qweight, grouped)], qweight.shape[0], bias,
                                quantize_activations)


def gguf_linear_segments(x: torch.Tensor, segments: Sequence[tuple], n: int,
                         bias: torch.Tensor | None = None,
                         quantize_activations: bool = False) -> torch.Tensor:
    """`gguf_linear` for a weight of N rows stored as row segments, each in its own GGML type
    (a fused qkv or gate_up weight of a Q4_K_M file), in one native call.

    Args:
        x: [..., K] floating, on the CPU.
        segments: (row_start, type name, qweight [rows, row_bytes] uint8[, grouped]) covering
            rows [0, n) exactly once, in any order (see `gguf_segment_structs`).
        n: the output size N.
        bias: [N] on the CPU, or None.
        quantize_activations: see `gguf_linear` (x is rounded once for all segments).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: as `gguf_linear`, or segments that do not cover [0, n) exactly once.
        RuntimeError: the native kernels are unavailable.
    """
    k = x.shape[-1]
    if x.device.type != "cpu" or not x.dtype.is_floating_point:
        raise ValueError(f"gguf_linear: x {tuple(x.shape)} {x.dtype} on {x.device} must be a "
                         f"floating CPU tensor")
    if k % GGUF_BLOCK_SIZE:
        raise ValueError(f"gguf_linear: K = {k} is not a multiple of {GGUF_BLOCK_SIZE}")
    structs = gguf_segment_structs(segments, k)
    covered = sorted((s.row_start, s.row_start + s.rows) for s in structs)
    if [b for _, b in covered[:-1]] != [a for a, _ in covered[1:]] or \
            (covered[0][0], covered[-1][1]) != (0, n):
        raise ValueError(f"gguf_linear: segments {covered} do not cover the rows [0, {n}) "
                         f"exactly once")
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        raise ValueError(f"gguf_linear: bias must be a CPU tensor of shape ({n},), got "
                         f"{tuple(bias.shape)} on {bias.device}")
    lib = require_kernels(None, "gguf_linear")
    x2 = x.reshape(-1, k).to(torch.float32)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    b_ptr = None if b is None else b.data_ptr()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    fn = lib.linear_gguf_segments_q8 if quantize_activations else lib.linear_gguf_segments
    rc = fn(x2.data_ptr(), x2.stride(0), x2.shape[0], k, structs, len(structs), b_ptr,
            y.data_ptr(), n)
    if rc != 0:
        raise RuntimeError(f"gguf_linear: the native kernel refused the segment types "
                           f"{[s[1] for s in segments]}")
    return y.view(*x.shape[:-1], n).to(x.dtype)


def gguf_quantize_activations(x: torch.Tensor, lib: ctypes.CDLL | None = None, block: int = 32
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rounding of x in `gguf_linear(..., quantize_activations=True)`, alone (natively):
    per block b of `block` values of a row, d[b] = max|x_b| / 127, q = round(x_b * (1 / d[b]))
    half to even (0 for an all-zero block), in float32.
    block=32 (the 32-value types; llama.cpp's `quantize_row_q8_0` plus its q8_1 sum): the third
    result is ds[b] = d[b] * sum(q_b).
    block=256 (the K-quants; llama.cpp's q8_K, symmetric): the third result is bsums, the int16
    sums of q per 16 values.

    Args:
        x: [M, K] float32 on the CPU, K a positive multiple of `block`.
        lib: the kernel library (default `cpu_kernels()`; tests pass other builds).
        block: 32 or 256.

    Returns:
        block=32: (q [M, K] int8, d [M, K / 32] float32, ds [M, K / 32] float32);
        block=256: (q [M, K] int8, d [M, K / 256] float32, bsums [M, K / 16] int16).

    Raises:
        ValueError: x not a 2-D float32 CPU tensor with K a positive multiple of `block`, or
            another block size.
        RuntimeError: the native kernels are unavailable.
    """
    if block not in (32, 256):
        raise ValueError(f"gguf_quantize_activations: block must be 32 or 256, got {block}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" \
            or x.shape[1] == 0 or x.shape[1] % block:
        raise ValueError(f"gguf_quantize_activations: x must be [M, K] float32 on the CPU with "
                         f"K a positive multiple of {block}, got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")
    lib = require_kernels(lib, "gguf_quantize_activations")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // block, dtype=torch.float32)
    if block == 32:
        third = torch.empty_like(d)
        fn = lib.quantize_rows_gguf_q8
    else:
        third = torch.empty(m, k // 16, dtype=torch.int16)
        fn = lib.quantize_rows_gguf_q8k
    fn(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr(), third.data_ptr())
    return q, d, third


def gguf_dequantize_rows(qweight: torch.Tensor, tensor_type: str, ids: torch.Tensor,
                         k: int, grouped: bool = False) -> torch.Tensor:
    """The rows `ids` of a GGUF-block weight, dequantized (an embedding lookup on a quantized
    token embedding; `csrc/cpu_gguf_linear.cpp`, the unpacking of `gguf_linear`).

    Args:
        qweight: [rows, k / block_weights * block_bytes] uint8, contiguous, on the CPU.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES.
        ids: [...] integer row indices in [0, rows).
        k: the row length in weights.
        grouped: qweight is in the row-group layout (`gguf_group_rows`).

    Returns:
        [..., k] float32.

    Raises:
        ValueError: an unsupported type, a weight that does not fit, or ids out of range.
        RuntimeError: the native kernels are unavailable.
    """
    structs = gguf_segment_structs([(0, tensor_type, qweight, grouped)], k)
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    lib = require_kernels(None, "gguf_dequantize_rows")
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    rc = lib.dequantize_rows_gguf(structs, k, flat.data_ptr(), flat.numel(), out.data_ptr())
    if rc == -2:   # (checked natively: a lookup per step, where two torch reductions cost more)
        raise ValueError(f"gguf_dequantize_rows: ids outside [0, {qweight.shape[0]})")
    if rc != 0:
        raise ValueError(f"gguf_dequantize_rows: tensor type {tensor_type} not supported")
    return out.view(*ids.shape, k)


def _check_int8_operands(name: str, x: torch.Tensor, qweight: torch.Tensor,
                         scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    n, k = qweight.shape if qweight.dim() == 2 else (None, None)
    if (qweight.dtype != torch.int8 or qweight.dim() != 2 or not qweight.is_contiguous()
            or k == 0 or qweight.device.type != "cpu"):
        raise ValueError(f"{name}: qweight must be a contiguous [N, K] int8 CPU tensor with "
                         f"K > 0, got {tuple(qweight.shape)} {qweight.dtype} on "
                         f"{qweight.device}")
    if x.device.type != "cpu" or not x.dtype.is_floating_point or x.dim() < 1 \
            or x.shape[-1] != k:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} on {x.device} must be a "
                         f"floating CPU tensor [..., {k}]")
    if scale.shape != (n,) or scale.dtype != torch.float32 or scale.device.type != "cpu" \
            or not scale.is_contiguous():
        raise ValueError(f"{name}: scale must be a contiguous float32 CPU tensor of shape "
                         f"({n},), got {tuple(scale.shape)} {scale.dtype} on {scale.device}")
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        raise ValueError(f"{name}: bias must be a CPU tensor of shape ({n},), got "
                         f"{tuple(bias.shape)} on {bias.device}")


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None,
                quantize_activations: bool = False) -> torch.Tensor:
    """y = (x @ qweight^T) * scale + bias with a per-output-channel int8 weight
    (`csrc/cpu_int8_linear.cpp`).

    Weight-only (the default): int8 weights widened to float32 in registers, activations and
    sums in float32; equal to x @ (qweight * scale[:, None])^T up to the order of the sums.
    With `quantize_activations` (W8A8): each row (token) t of x is first rounded to int8,
    xs[t] = max|x[t, :]| / 127, xq = round(x / xs) (half to even) in [-127, 127]; int8 x int8
    products are summed exactly in int32 and y = acc * xs[t] * scale + bias
    (`quantize_per_token_int8` gives xq and xs alone).

    Args:
        x: [..., K] float32/bfloat16/float16 on the CPU (computed in float32).
        qweight: [N, K] int8, contiguous, on the CPU; any K >= 1.
        scale: [N] float32, contiguous: row n of the weight is scale[n] * qweight[n].
        bias: [N] on the CPU, or None.
        quantize_activations: W8A8 instead of weight-only (see above).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (naming them).
        RuntimeError: the native kernels are unavailable (see `pagedllm.native.kernels.cpu_kernels`).
    """
    _check_int8_operands("int8_linear", x, qweight, scale, bias)
    lib = require_kernels(None, "int8_linear")
    n, k = qweight.shape
    x2 = x.reshape(-1, k).to(torch.float32)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    fn = lib.linear_w8a8_f32 if quantize_activations else lib.linear_int8_f32
    fn(x2.data_ptr(), x2.stride(0), x2.shape[0], k, qweight.data_ptr(), n, scale.data_ptr(),
       None if b is None else b.data_ptr(), y.data_ptr(), n)
    return y.view(*x.shape[:-1], n).to(x.dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token activation quantization of `int8_linear(..., quantize_activations=True)`,
    natively: xs[t] = max|x[t, :]| / 127 (0 for a zero row), xq = round(x / xs) half to even,
    clamped to [-127, 127].

    Args:
        x: [M, K] float32 on the CPU, K >= 1.

    Returns:
        (xq [M, K] int8, xs [M] float32).

    Raises:
        ValueError: x not a 2-D float32 CPU tensor.
        RuntimeError: the native kernels are unavailable.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0:
        raise ValueError(f"quantize_per_token_int8: x must be [M, K>0] float32 on the CPU, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    lib = require_kernels(None, "quantize_per_token_int8")
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty(x.shape, dtype=torch.int8)
    xs = torch.empty(x.shape[0], dtype=torch.float32)
    lib.quantize_rows_int8(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], xq.data_ptr(),
                           xs.data_ptr())
    return xq, xs
