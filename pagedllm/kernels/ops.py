"""Python entry points of the native CPU kernels (see `csrc/`), on torch tensors."""

from __future__ import annotations

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


# GGML block types `gguf_linear` computes on: name -> (ggml_type code, bytes per 32-weight block).
GGUF_KERNEL_TYPES = {"Q8_0": (8, 34), "Q4_0": (2, 18), "Q4_1": (3, 20)}
GGUF_BLOCK_SIZE = 32  # weights per block of every type in GGUF_KERNEL_TYPES
# Types with the 8-bit activation variant (`quantize_activations=True`).
GGUF_Q8_ACTIVATION_TYPES = ("Q8_0", "Q4_0")


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, tensor_type: str,
                bias: torch.Tensor | None = None,
                quantize_activations: bool = False) -> torch.Tensor:
    """y = x @ dequantize(qweight)^T + bias with the weight kept in its GGML block format; each
    block is unpacked in registers inside the dot product (`csrc/cpu_gguf_linear.cpp`, as in
    llama.cpp's ggml), activations and sums in float32.

    Args:
        x: [..., K] float32/bfloat16/float16 on the CPU (computed in float32); K a multiple of 32.
        qweight: [N, K / 32 * block_bytes] uint8, contiguous: each row K / 32 consecutive blocks,
            as a GGUF file stores them.
        tensor_type: a GGML type name in GGUF_KERNEL_TYPES ("Q8_0", "Q4_0", "Q4_1").
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
    if tensor_type not in GGUF_KERNEL_TYPES:
        raise ValueError(f"gguf_linear: tensor type {tensor_type} not supported; supported: "
                         f"{', '.join(GGUF_KERNEL_TYPES)}")
    if quantize_activations and tensor_type not in GGUF_Q8_ACTIVATION_TYPES:
        raise ValueError(f"gguf_linear: 8-bit activations only with "
                         f"{', '.join(GGUF_Q8_ACTIVATION_TYPES)}, not {tensor_type}")
    code, block_bytes = GGUF_KERNEL_TYPES[tensor_type]
    k = x.shape[-1]
    if (x.device.type != "cpu" or qweight.device.type != "cpu" or qweight.dtype != torch.uint8
            or qweight.dim() != 2 or not qweight.is_contiguous() or k % GGUF_BLOCK_SIZE
            or qweight.shape[1] != k // GGUF_BLOCK_SIZE * block_bytes
            or not x.dtype.is_floating_point):
        raise ValueError(
            f"gguf_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit the "
            f"{tensor_type} weight {tuple(qweight.shape)} {qweight.dtype} on {qweight.device} (needs CPU "
            f"tensors, floating x with K a multiple of {GGUF_BLOCK_SIZE}, a contiguous uint8 "
            f"weight of K / {GGUF_BLOCK_SIZE} * {block_bytes} bytes per row)")
    n = qweight.shape[0]
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
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    fn = lib.linear_gguf_q8_activations if quantize_activations else lib.linear_gguf_f32
    fn(x2.data_ptr(), x2.stride(0), x2.shape[0], k, qweight.data_ptr(), n, code,
       None if b is None else b.data_ptr(), y.data_ptr(), n)
    return y.view(*x.shape[:-1], n).to(x.dtype)
