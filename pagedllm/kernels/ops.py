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
