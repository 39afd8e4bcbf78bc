"""Python entry points of the native CPU kernels (see `csrc/`), on torch tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedllm.kernels import cpu_kernels

_LINEAR_DTYPES = (torch.float32, torch.bfloat16)


def cpu_linear_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `cpu_linear` can take these operands (CPU tensors, float32/bfloat16 weight laid out
    as [N, K] with K a multiple of 8, float32/bfloat16 activations) and the kernels built."""
    return (x.device.type == "cpu" and weight.device.type == "cpu"
            and weight.dtype in _LINEAR_DTYPES and x.dtype in _LINEAR_DTYPES
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] > 0
            and weight.shape[1] % 8 == 0 and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and cpu_kernels() is not None)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               checked: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias with the native kernel (weights widened in registers).

    Args:
        x: [..., K] float32 or bfloat16 (computed in float32; with a bf16 weight, bf16
            activations are read and written as bf16 by the kernel, rounded to nearest even).
        weight: [N, K] float32 or bfloat16, contiguous, K % 8 == 0 (see `cpu_linear_supported`).
        bias: [N] on the CPU, or None.
        checked: the caller already saw `cpu_linear_supported(x, weight)` return True.

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: if the operands are not supported (check `cpu_linear_supported` first).
    """
    if not checked and not cpu_linear_supported(x, weight):
        raise ValueError(
            f"cpu_linear does not support x {tuple(x.shape)} {x.dtype} with weight "
            f"{tuple(weight.shape)} {weight.dtype} (needs CPU tensors, float32/bfloat16, a "
            f"contiguous [N, K] weight with K a positive multiple of 8 matching x's last dim, "
            f"and the built kernels)")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device.type != "cpu"):
        raise ValueError(f"cpu_linear: bias must be a CPU tensor of shape ({weight.shape[0]},), "
                         f"got {tuple(bias.shape)} on {bias.device}")
    lead = x.shape[:-1]
    n = weight.shape[0]
    b = None if bias is None else bias.to(torch.float32).contiguous()
    lib = cpu_kernels()
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        fn, act_dtype = lib.linear_bf16_act, torch.bfloat16   # no casts around the call
    else:
        fn = lib.linear_f32 if weight.dtype == torch.float32 else lib.linear_bf16
        act_dtype = torch.float32
    x2 = x.reshape(-1, x.shape[-1]).to(act_dtype)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    y = torch.empty(m, n, dtype=act_dtype)
    fn(x2.data_ptr(), x2.stride(0), m, k, weight.data_ptr(), n,
       None if b is None else b.data_ptr(), y.data_ptr(), n)
    return y.view(*lead, n).to(x.dtype)


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
# Types with the 8-bit activation variant (`quantize_activations=True`).
GGUF_Q8_ACTIVATION_TYPES = ("Q8_0", "Q4_0")


class GGUFSegmentStruct(ctypes.Structure):
    """Mirror of `pagedllm::gguf::Segment` (csrc/gguf_blocks.h): rows [row_start, row_start +
    rows) of a weight, stored at `data` as [rows, row_bytes] blocks of type `ggml_type`."""

    _fields_ = [("data", ctypes.c_void_p), ("row_start", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("ggml_type", ctypes.c_int64)]


def gguf_segment_structs(segments: Sequence[tuple[int, str, torch.Tensor]],
                         k: int) -> ctypes.Array:
    """The native description of a weight's row segments, checked against input size `k`.

    Args:
        segments: (row_start, GGML type name, qweight [rows, k / block_weights * block_bytes]
            uint8 contiguous CPU tensor) per segment; the caller keeps the tensors alive while
            the structures are in use.
        k: the input size (a multiple of each type's block_weights).

    Raises:
        ValueError: an unsupported type, or a qweight / k that does not fit it (naming both).
    """
    structs = (GGUFSegmentStruct * len(segments))()
    for struct, (row_start, tensor_type, qweight) in zip(structs, segments):
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
    return structs


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, tensor_type: str,
                bias: torch.Tensor | None = None,
                quantize_activations: bool = False) -> torch.Tensor:
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
        quantize_activations: first round x to 8 bits per 32-value block (scale = block
            max / 127) and use integer dot products, as llama.cpp does for Q8_0/Q4_0
            (GGUF_Q8_ACTIVATION_TYPES); not exact (relative error ~1e-2), measured in the
            report of issue #22, not used by the layers.

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: an unsupported type, shapes or dtypes that do not fit, non-CPU tensors.
        RuntimeError: the native kernels are unavailable (see `pagedllm.kernels.cpu_kernels`).
    """
    if quantize_activations and tensor_type not in GGUF_Q8_ACTIVATION_TYPES:
        raise ValueError(f"gguf_linear: 8-bit activations only with "
                         f"{', '.join(GGUF_Q8_ACTIVATION_TYPES)}, not {tensor_type}")
    return gguf_linear_segments(x, [(0, tensor_type, qweight)], qweight.shape[0], bias,
                                quantize_activations)


def gguf_linear_segments(x: torch.Tensor, segments: Sequence[tuple[int, str, torch.Tensor]],
                         n: int, bias: torch.Tensor | None = None,
                         quantize_activations: bool = False) -> torch.Tensor:
    """`gguf_linear` for a weight of N rows stored as row segments, each in its own GGML type
    (a fused qkv or gate_up weight of a Q4_K_M file), in one native call.

    Args:
        x: [..., K] floating, on the CPU.
        segments: (row_start, type name, qweight [rows, row_bytes] uint8) covering rows [0, n)
            exactly once, in any order.
        n: the output size N.
        bias: [N] on the CPU, or None.
        quantize_activations: see `gguf_linear` (one segment of a GGUF_Q8_ACTIVATION_TYPES
            type only).

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
    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError("gguf_linear needs the native CPU kernels, which are unavailable "
                           "(see the log; PAGEDLLM_CPU_KERNELS switches them off)")
    x2 = x.reshape(-1, k).to(torch.float32)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    b_ptr = None if b is None else b.data_ptr()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if quantize_activations:
        if len(segments) != 1 or segments[0][1] not in GGUF_Q8_ACTIVATION_TYPES:
            raise ValueError(f"gguf_linear: 8-bit activations only with one segment of "
                             f"{', '.join(GGUF_Q8_ACTIVATION_TYPES)}")
        rc = lib.linear_gguf_q8_activations(x2.data_ptr(), x2.stride(0), x2.shape[0], k,
                                            structs[0].data, n, structs[0].ggml_type, b_ptr,
                                            y.data_ptr(), n)
    else:
        rc = lib.linear_gguf_segments(x2.data_ptr(), x2.stride(0), x2.shape[0], k, structs,
                                      len(structs), b_ptr, y.data_ptr(), n)
    if rc != 0:
        raise RuntimeError(f"gguf_linear: the native kernel refused the segment types "
                           f"{[s[1] for s in segments]}")
    return y.view(*x.shape[:-1], n).to(x.dtype)


def gguf_dequantize_rows(qweight: torch.Tensor, tensor_type: str, ids: torch.Tensor,
                         k: int) -> torch.Tensor:
    """The rows `ids` of a GGUF-block weight, dequantized (an embedding lookup on a quantized
    token embedding; `csrc/cpu_gguf_linear.cpp`, the unpacking of `gguf_linear`).

    Args:
        qweight: [rows, k / block_weights * block_bytes] uint8, contiguous, on the CPU.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES.
        ids: [...] integer row indices in [0, rows).
        k: the row length in weights.

    Returns:
        [..., k] float32.

    Raises:
        ValueError: an unsupported type, a weight that does not fit, or ids out of range.
        RuntimeError: the native kernels are unavailable.
    """
    struct = gguf_segment_structs([(0, tensor_type, qweight)], k)[0]
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= qweight.shape[0]):
        raise ValueError(f"gguf_dequantize_rows: ids outside [0, {qweight.shape[0]})")
    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError("gguf_dequantize_rows needs the native CPU kernels, which are "
                           "unavailable (see the log)")
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    lib.dequantize_rows_gguf(struct.data, k, struct.ggml_type, flat.data_ptr(), flat.numel(),
                             out.data_ptr())
    return out.view(*ids.shape, k)
