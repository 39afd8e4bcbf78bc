"""Python entry points of the native CPU kernels on float weights (see `csrc/`): dense and
packed GEMMs and the fused MoE. Attention is in `attention_ops.py`, quantized weights (GGUF,
int8) in `quantized_ops.py`."""

from __future__ import annotations

import ctypes

import torch

from pagedllm.native.kernels import cpu_kernels

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
    if (checked and bias is None and x.dtype is torch.float32 and weight.dtype is torch.float32
            and x.dim() == 2 and x.is_contiguous()):
        # Float32 rows (a router, a replicated projection) without the general path's no-op
        # casts and views (see NOTE(batch-1) in `packed_linear`).
        m, k, n = x.shape[0], x.shape[1], weight.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            cpu_kernels().linear_f32(x.data_ptr(), k, m, k, weight.data_ptr(), n, None,
                                     y.data_ptr(), n)
        return y
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


def packed_gemm_supported(weight: torch.Tensor) -> bool:
    """Whether `pack_linear_weight` takes `weight`: a contiguous float32/bfloat16 [N, K] CPU
    tensor with K a positive multiple of 8 (what `packed_linear` then computes on)."""
    return (weight.device.type == "cpu" and weight.dtype in _LINEAR_DTYPES
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[0] > 0
            and weight.shape[1] > 0 and weight.shape[1] % 8 == 0)


def require_kernels(lib: ctypes.CDLL | None, what: str) -> ctypes.CDLL:
    """`lib`, else the process's native kernel library (`cpu_kernels`).

    Raises:
        RuntimeError: the native kernels are unavailable (names `what`, the caller).
    """
    lib = lib if lib is not None else cpu_kernels()
    if lib is None:
        raise RuntimeError(f"{what} needs the native CPU kernels, which are unavailable (see the "
                           f"log; PAGEDLLM_CPU_KERNELS switches them off)")
    return lib


def _packing_lib(weight: torch.Tensor, lib: ctypes.CDLL | None, what: str) -> ctypes.CDLL:
    lib = require_kernels(lib, what)
    if not packed_gemm_supported(weight):
        raise ValueError(f"{what}: weight {tuple(weight.shape)} {weight.dtype} on "
                         f"{weight.device} is not a contiguous float32/bfloat16 [N, K] CPU "
                         f"tensor with K a positive multiple of 8")
    return lib


_PAIRS_FORMS = {1: "dot", 2: "widen"}


def packed_pairs_form(lib: ctypes.CDLL | None = None) -> str | None:
    """The kernel that multiplies bf16 weights packed as k pairs (`csrc/packed_gemm.h`
    `Kernel`): "dot" (`vdpbf16ps`) or "widen" (each pair widened to float32, two FMAs; the same
    bits), chosen by timing both instructions once per process (the first call measures,
    a few ms); None where the library packs no pairs (no AVX512_BF16).

    Raises:
        RuntimeError: the native kernels are unavailable.
    """
    lib = require_kernels(lib, "packed_pairs_form")
    return _PAIRS_FORMS.get(lib.packed_gemm_pairs_form())


def set_packed_pairs_form(form: str, lib: ctypes.CDLL | None = None) -> None:
    """Make every later packed GEMM on bf16 pair panels in this process use `form` ("dot" or
    "widen", see `packed_pairs_form`) instead of the measured choice: for tests and
    benchmarks; call it outside a running GEMM.

    Raises:
        ValueError: `form` is not "dot" or "widen", or the library packs no pairs.
        RuntimeError: the native kernels are unavailable.
    """
    lib = require_kernels(lib, "set_packed_pairs_form")
    codes = {name: code for code, name in _PAIRS_FORMS.items()}
    if form not in codes:
        raise ValueError(f"set_packed_pairs_form: form must be 'dot' or 'widen', got {form!r}")
    if lib.packed_gemm_set_pairs_form(codes[form]) != codes[form]:
        raise ValueError("set_packed_pairs_form: this kernel library packs no bf16 pairs "
                         "(built without AVX512_BF16)")


def pack_linear_weight(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """`weight` [N, K] rearranged into the packed-B GEMM's panels (`csrc/packed_gemm.h`: [N/16]
    panels of [K][16] values, bf16 as [K/2][16][2] pairs where the library has AVX512_BF16, a
    tail panel for N % 16), returned as a new tensor of the same shape and dtype (only
    `packed_linear` of the same library build may read it).

    Args:
        weight: [N, K] float32 or bfloat16, contiguous, on the CPU, K % 8 == 0.
        lib: the kernel library (default `cpu_kernels()`; tests pass other builds).

    Raises:
        ValueError: an unsupported weight (see `packed_gemm_supported`).
        RuntimeError: the native kernels are unavailable.
    """
    lib = _packing_lib(weight, lib, "pack_linear_weight")
    out = torch.empty_like(weight)
    lib.pack_linear_weight(weight.data_ptr(), weight.shape[0], weight.shape[1],
                           _LINEAR_DTYPES.index(weight.dtype), out.data_ptr())
    return out


def unpack_linear_weight(packed: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The [N, K] row-major weight back from `pack_linear_weight`'s output (a new tensor).

    Raises:
        ValueError, RuntimeError: as `pack_linear_weight`.
    """
    lib = _packing_lib(packed, lib, "unpack_linear_weight")
    out = torch.empty_like(packed)
    lib.unpack_linear_weight(packed.data_ptr(), packed.shape[0], packed.shape[1],
                             _LINEAR_DTYPES.index(packed.dtype), out.data_ptr())
    return out


def packed_weight_rows(packed: torch.Tensor, ids: torch.Tensor,
                       lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows `ids` of the [N, K] weight that `pack_linear_weight` packed: an embedding lookup on
    a tied LM head's packed weight (`csrc/packed_gemm.h` `gather_rows`).

    Args:
        packed: [N, K] from `pack_linear_weight` of the same library.
        ids: [...] integer row indices in [0, N).
        lib: the kernel library (default `cpu_kernels()`).

    Returns:
        [..., K] in packed's dtype.

    Raises:
        ValueError: an unsupported weight, or ids outside [0, N).
        RuntimeError: the native kernels are unavailable.
    """
    lib = _packing_lib(packed, lib, "packed_weight_rows")
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    n, k = packed.shape
    out = torch.empty(flat.numel(), k, dtype=packed.dtype)
    if lib.packed_weight_rows(packed.data_ptr(), n, k, _LINEAR_DTYPES.index(packed.dtype),
                              flat.data_ptr(), flat.numel(), out.data_ptr()) != 0:
        raise ValueError(f"packed_weight_rows: ids outside [0, {n})")
    return out.view(*ids.shape, k)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: torch.Tensor | None = None,
                  lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y = x @ W^T + bias with the packed-B GEMM (`csrc/packed_gemm.h`), W given packed.

    Math in float32, except that with bfloat16 weights on an AVX512_BF16 build x is rounded to
    bfloat16 and multiplied as bf16 pairs with float32 accumulation (`vdpbf16ps`, or widening
    FMAs with the same bits where those are faster: `packed_pairs_form`). A bfloat16 x with a
    bfloat16 weight is read and written as bfloat16 (rounded to nearest even); other
    combinations compute on float32 x.

    Args:
        x: [..., K] float32 or bfloat16 on the CPU.
        packed_weight: [N, K] from `pack_linear_weight` of the same library.
        bias: [N] on the CPU, or None.
        lib: the kernel library (default `cpu_kernels()`).

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: unsupported operands or a bias of the wrong shape (naming them).
        RuntimeError: the native kernels are unavailable.
    """
    if (lib is None and bias is None and x.dtype is torch.float32
            and packed_weight.dtype is torch.float32 and x.dim() == 2
            and packed_weight.dim() == 2 and x.shape[1] == packed_weight.shape[1]
            and x.shape[1] % 8 == 0 and x.is_cpu and packed_weight.is_cpu
            and x.is_contiguous() and packed_weight.is_contiguous()):
        # NOTE(batch-1): the float32 rows of a module-path linear, checked with a dozen cheap
        # attribute reads and called without the general path's no-op casts and views: at a
        # decode step's one row those cost several times the GEMV of a small weight (a
        # [16, 768] GEMV: 50 -> 12 us per call on a loaded host; docs/benchmarks.md).
        fast_lib = cpu_kernels()
        if fast_lib is not None:
            m, n = x.shape[0], packed_weight.shape[0]
            y = torch.empty(m, n, dtype=torch.float32)
            if m:
                k = x.shape[1]
                fast_lib.packed_linear_f32(x.data_ptr(), k, m, k, packed_weight.data_ptr(), n,
                                           None, y.data_ptr(), n)
            return y
    lib = _packing_lib(packed_weight, lib, "packed_linear")
    n, k = packed_weight.shape
    if x.device.type != "cpu" or x.dtype not in _LINEAR_DTYPES or x.dim() < 1 \
            or x.shape[-1] != k:
        raise ValueError(f"packed_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not "
                         f"fit the weight [{n}, {k}] (needs float32/bfloat16 [..., {k}] on the "
                         f"CPU)")
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        raise ValueError(f"packed_linear: bias must be a CPU tensor of shape ({n},), got "
                         f"{tuple(bias.shape)} on {bias.device}")
    b = None if bias is None else bias.to(torch.float32).contiguous()
    if x.dtype == torch.bfloat16 and packed_weight.dtype == torch.bfloat16:
        fn, act_dtype = lib.packed_linear_bf16_act, torch.bfloat16
    else:
        fn = (lib.packed_linear_f32 if packed_weight.dtype == torch.float32
              else lib.packed_linear_bf16)
        act_dtype = torch.float32
    x2 = x.reshape(-1, k).to(act_dtype)
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=act_dtype)
    if m:
        fn(x2.data_ptr(), x2.stride(0), m, k, packed_weight.data_ptr(), n,
           None if b is None else b.data_ptr(), y.data_ptr(), n)
    return y.view(*x.shape[:-1], n).to(x.dtype)


_LINEAR_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def fused_moe_supported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `cpu_fused_moe` takes these operands: CPU tensors, float32/bfloat16 hidden
    states [n, H] and contiguous stacked expert weights w13 [L, 2I, H], w2 [L, H, I] of one
    float32/bfloat16 dtype, H and I positive multiples of 8 (the AVX2 micro-kernels' step);
    whether the kernels built is `cpu_kernels()`'s business."""
    return (hidden.device.type == "cpu" and w13.device.type == "cpu"
            and w2.device.type == "cpu" and hidden.dtype in _LINEAR_DTYPE_CODES
            and w13.dtype in _LINEAR_DTYPE_CODES and w2.dtype == w13.dtype
            and hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3
            and w13.is_contiguous() and w2.is_contiguous()
            and w13.shape[2] == hidden.shape[1] == w2.shape[1] and w13.shape[0] == w2.shape[0]
            and w13.shape[1] == 2 * w2.shape[2] and hidden.shape[1] % 8 == 0
            and w2.shape[2] % 8 == 0 and hidden.shape[1] > 0 and w2.shape[2] > 0)


def cpu_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, local_ids: torch.Tensor,
                  lib: ctypes.CDLL | None = None, checked: bool = False) -> torch.Tensor:
    """The routed experts of one MoE layer in one native call (`csrc/cpu_fused_moe.cpp`):

        out[t] = sum_j topk_weights[t, j] * (silu(x W1^T) * (x W3^T)) W2^T   over the experts
                 e = local_ids[t, j] held here (0 <= e < L; others are skipped)

    Pairs are grouped by expert with a counting sort and each expert's rows run as one GEMM per
    weight tile; the k rows of a token are summed in slot order (deterministic). With bfloat16
    activations the intermediates are rounded where `fused_experts`' torch path rounds them.

    Args:
        hidden: [n, H] float32 or bfloat16 (the model dtype) on the CPU.
        w13: [L, 2I, H] (gate rows, then up rows) and w2: [L, H, I], contiguous, one dtype of
            float32/bfloat16; H and I multiples of 8 (see `fused_moe_supported`).
        topk_weights: [n, k] routing weights (read as float32).
        local_ids: [n, k] integer local expert slots; -1 or >= L (another rank's expert under
            expert parallelism) contributes nothing.
        lib: the kernel library (default `cpu_kernels()`; tests pass a portable build).
        checked: the caller already saw `fused_moe_supported(hidden, w13, w2)` hold.

    Returns:
        [n, H] in hidden's dtype.

    Raises:
        ValueError: unsupported operands (naming them) or mismatched routing shapes.
        RuntimeError: the native kernels are unavailable.
    """
    lib = require_kernels(lib, "cpu_fused_moe")
    if not checked and not fused_moe_supported(hidden, w13, w2):
        raise ValueError(
            f"cpu_fused_moe does not support hidden {tuple(hidden.shape)} {hidden.dtype} with "
            f"w13 {tuple(w13.shape)} {w13.dtype} and w2 {tuple(w2.shape)} {w2.dtype} (needs "
            f"CPU tensors, float32/bfloat16, contiguous [L, 2I, H] / [L, H, I] weights of one "
            f"dtype, hidden [n, H], H and I positive multiples of 8)")
    num_tokens = hidden.shape[0]
    if (local_ids.dim() != 2 or local_ids.shape[0] != num_tokens
            or topk_weights.shape != local_ids.shape
            or local_ids.dtype.is_floating_point or local_ids.dtype == torch.bool):
        raise ValueError(f"cpu_fused_moe: local_ids {tuple(local_ids.shape)} {local_ids.dtype} "
                         f"and topk_weights {tuple(topk_weights.shape)} must both be "
                         f"[{num_tokens}, k], the ids integers")
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    x = hidden.contiguous()
    ids = local_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    rc = lib.fused_moe_experts(x.data_ptr(), _LINEAR_DTYPE_CODES[x.dtype], num_tokens,
                               x.shape[1], w13.data_ptr(), w2.data_ptr(),
                               _LINEAR_DTYPE_CODES[w13.dtype], w13.shape[0], w2.shape[2],
                               ids.data_ptr(), weights.data_ptr(), ids.shape[1], out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"fused_moe_experts failed with code {rc}")
    return out
