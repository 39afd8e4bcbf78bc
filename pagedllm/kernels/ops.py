"""Python entry points of the native CPU kernels (see `csrc/`), on torch tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.attention.backends.kv_quant import kv_cache_scales
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


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray,
                    scale: float, causal: bool = True, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, query_tile: int | None = None,
                    lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Paged attention of the given requests over a KV cache with the native kernel
    (`csrc/cpu_attention.cpp`; what `CpuPagedBackend` calls, without writing the cache).

    Query token i of request r sits at position seq_lens[r] - query_len[r] + i and attends
    (causally, within the window, soft-capped) to the K/V its block table points to.

    Args:
        query: [num_tokens, num_heads, head_size] float32 on the CPU (other float dtypes are
            converted).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size] float32, bfloat16, or
            int8 / float8_e4m3fn made by `kv_quant.allocate_kv_cache` (with its scales).
        block_table: [num_reqs, max_blocks] int32, unit stride along a row.
        query_start_loc, seq_lens: [num_reqs + 1] / [num_reqs] int32 numpy.
        rows: [R] int32 numpy, the requests to compute (the other tokens' outputs are zero).
        scale: softmax scale.
        causal, sliding_window, logits_soft_cap: as in `CpuPagedBackend.forward`.
        query_tile: query tokens per work item for requests with several query tokens (each
            K/V block is read once per tile); 1 = one token per item, the per-token path;
            None = the library's default (16).
        lib: the kernel library (default `cpu_kernels()`; tests pass a portable build).

    Returns:
        [num_tokens, num_heads, head_size] float32.

    Raises:
        ValueError: an unsupported cache dtype, mismatched shapes, or query_tile < 1.
        RuntimeError: the native kernels are unavailable.
    """
    lib = lib if lib is not None else cpu_kernels()
    if lib is None:
        raise RuntimeError("paged_attention needs the native CPU kernels, which are "
                           "unavailable (see the log)")
    if query_tile is not None and query_tile < 1:
        raise ValueError(f"paged_attention: query_tile must be >= 1, got {query_tile}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or query.dim() != 3 \
            or query.shape[2] != kv_cache.shape[4] or query.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} does not fit the KV "
                         f"cache {tuple(kv_cache.shape)} (needs [T, H, D] and [2, blocks, "
                         f"block_size, KVH, D] with H a multiple of KVH)")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError(f"paged_attention: block_table must be int32 with unit row stride, "
                         f"got {block_table.dtype} strides {block_table.stride()}")
    for name, a in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("rows", rows)):
        if a.dtype != np.int32 or not a.flags.c_contiguous:
            raise ValueError(f"paged_attention: {name} must be a contiguous int32 array")
    suffix = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "int8",
              torch.float8_e4m3fn: "fp8_e4m3"}.get(kv_cache.dtype)
    if suffix is None:
        raise ValueError(f"paged_attention: KV cache dtype {kv_cache.dtype} not supported")
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    caches: tuple = (key_cache.data_ptr(), value_cache.data_ptr())
    if kv_cache.dtype == torch.int8:
        scales = kv_cache_scales(kv_cache)
        caches += (scales[0].data_ptr(), scales[1].data_ptr())
    elif kv_cache.dtype == torch.float8_e4m3fn:
        k_scale, v_scale = kv_cache_scales(kv_cache).tolist()
        caches += (ctypes.c_float(k_scale), ctypes.c_float(v_scale))
    name = f"paged_attention_{suffix}"
    fn = getattr(lib, name) if query_tile is None else getattr(lib, name + "_tiled")
    tile = () if query_tile is None else (query_tile,)
    q32 = query.to(torch.float32).contiguous()
    num_heads, head_size = query.shape[1], query.shape[2]
    out = torch.zeros(q32.shape, dtype=torch.float32)
    fn(q32.data_ptr(), *caches, block_table.data_ptr(), block_table.stride(0),
       query_start_loc.ctypes.data, seq_lens.ctypes.data, rows.ctypes.data, len(rows),
       out.data_ptr(), num_heads, kv_cache.shape[3], head_size, kv_cache.shape[2],
       ctypes.c_float(scale), int(causal), sliding_window or 0,
       ctypes.c_float(logits_soft_cap or 0.0), *tile)
    return out


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
        RuntimeError: the native kernels are unavailable (see `pagedllm.kernels.cpu_kernels`).
    """
    _check_int8_operands("int8_linear", x, qweight, scale, bias)
    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError("int8_linear needs the native CPU kernels, which are unavailable "
                           "(see the log; PAGEDLLM_CPU_KERNELS switches them off)")
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
    lib = cpu_kernels()
    if lib is None:
        raise RuntimeError("quantize_per_token_int8 needs the native CPU kernels")
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty(x.shape, dtype=torch.int8)
    xs = torch.empty(x.shape[0], dtype=torch.float32)
    lib.quantize_rows_int8(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], xq.data_ptr(),
                           xs.data_ptr())
    return xq, xs
