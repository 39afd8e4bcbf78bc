"""Linear layers whose float checkpoint weights are quantized to int8 at load (issue #22):
symmetric, one scale per output channel (row), so tensor-parallel shards and the rows of fused
qkv / gate_up weights quantize independently and simply stack.

    checkpoint W [rows, in] (this rank's shard) ──quantize_weight_per_channel──►
        layer.weight [out, in] int8 (rows [offset, offset + rows)), layer.weight_scale [out] f32

    "int8" (weight-only): y = (x @ Wq^T) * scale + bias, activations in the model dtype
    "w8a8": also x per token: xs[t] = max|x[t]| / 127, y = (xq @ Wq^T) * xs[t] * scale + bias

On the CPU both run natively (`ops.int8_linear`, csrc/cpu_int8_linear.cpp); elsewhere, or
without the kernels, torch computes the same formulas in float32. The fused CPU decoder
(native/fused_decoder.py) takes these layers through `Int8LinearMethod.kernel_weight` and runs
the same kernels (csrc/int8_blocks.h) inside its parallel region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.quantized_ops import int8_linear
from pagedllm.layers.quantization.base import LinearMethodBase

INT8_MAX = 127


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a weight.

    scale[o] = max|W[o, :]| / 127 (computed in float32), Wq = round(W / scale) (half to even),
    within [-127, 127]; an all-zero row gets scale 0 and zero quants. W ~= Wq * scale[:, None].

    Args:
        weight: [out, in] floating.

    Returns:
        (qweight [out, in] int8, scale [out] float32), on weight's device.

    Raises:
        ValueError: weight not a 2-D floating tensor.
    """
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"int8 quantization takes a 2-D floating weight, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    qweight = torch.round(w / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight, scale


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token activation quantization of W8A8, in torch (the reference of the native
    one, `ops.quantize_per_token_int8`): xs[t] = max|x[t, :]| / 127 in float32, xq = round(x /
    xs) half to even in [-127, 127] (zero rows: xs 0, xq 0).

    Args:
        x: [M, K] floating.

    Returns:
        (xq [M, K] int8, xs [M] float32).
    """
    x = x.to(torch.float32)
    xs = x.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(xs > 0, xs, torch.ones_like(xs))
    return torch.round(x / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), xs


@dataclass(frozen=True)
class Int8KernelWeight:
    """What a native caller (the fused CPU decoder) needs to run an int8 linear.

    Attributes:
        qweight: [N, K] int8, contiguous, on the CPU.
        scale: [N] float32, contiguous: row n of the weight is scale[n] * qweight[n].
        quantize_activations: W8A8 (x quantized per token) instead of weight-only.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    quantize_activations: bool


class Int8LinearMethod(LinearMethodBase):
    """Keeps a linear layer's weight as int8 with one float32 scale per output row.

    After loading, `layer.weight` is [output_size_per_partition, input_size_per_partition] int8
    and `layer.weight_scale` [output_size_per_partition] float32 (a buffer); the bias (if any)
    stays in the model dtype.

    Args:
        quantize_activations: W8A8 (activations quantized per token, integer dot products)
            instead of weight-only int8.
    """

    quantized = True

    def __init__(self, quantize_activations: bool = False) -> None:
        self.quantize_activations = quantize_activations

    def batch_invariant(self, layer: nn.Module) -> bool:
        """W8A8 only: its integer sums are exact and each row is scaled alone; the
        weight-only kernel's batch-1 GEMV sums in two chains where its row tiles use one."""
        return self.quantize_activations

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_size_per_partition: int, weight_loader) -> None:
        old = getattr(layer, "weight", None)
        device = old.device if isinstance(old, torch.Tensor) else None
        weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition,
                                          dtype=torch.int8, device=device), requires_grad=False)
        weight.weight_loader = weight_loader
        layer.weight = weight
        scale = torch.zeros(output_size_per_partition, dtype=torch.float32, device=device)
        if "weight_scale" in layer._buffers:
            layer.weight_scale = scale
        else:
            layer.register_buffer("weight_scale", scale, persistent=False)

    def load_weight(self, layer: nn.Module, loaded, row_offset: int | None) -> None:
        out, k = layer.weight.shape
        rows, start = loaded.shape[0], 0 if row_offset is None else row_offset
        if tuple(loaded.shape[1:]) != (k,) or (row_offset is None and rows != out) \
                or start + rows > out:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} for rows "
                             f"[{start}, {start + rows}) of an int8 weight {(out, k)}")
        w = loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()
        qweight, scale = quantize_weight_per_channel(w)
        layer.weight.data.narrow(0, start, rows).copy_(qweight)
        layer.weight_scale.narrow(0, start, rows).copy_(scale)

    def kernel_weight(self, layer: nn.Module) -> Int8KernelWeight:
        """The loaded weight for the fused CPU decoder (native/fused_decoder.py), which runs it
        with the kernels of `ops.int8_linear` (csrc/int8_blocks.h) inside its parallel region.

        Raises:
            ValueError: the weight or scale is not a contiguous CPU tensor of the expected
                dtype and shape.
        """
        qweight, scale = layer.weight.data, layer.weight_scale
        if (qweight.dtype != torch.int8 or qweight.dim() != 2 or not qweight.is_contiguous()
                or qweight.device.type != "cpu" or scale.dtype != torch.float32
                or tuple(scale.shape) != (qweight.shape[0],) or not scale.is_contiguous()
                or scale.device.type != "cpu"):
            raise ValueError(f"{type(layer).__name__}: the fused decoder needs a contiguous "
                             f"[N, K] int8 CPU weight with [N] float32 scales, got "
                             f"{tuple(qweight.shape)} {qweight.dtype} on {qweight.device} and "
                             f"{tuple(scale.shape)} {scale.dtype} on {scale.device}")
        return Int8KernelWeight(qweight, scale, self.quantize_activations)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cpu" and cpu_kernels() is not None:
            return int8_linear(x, layer.weight, layer.weight_scale, bias,
                               self.quantize_activations)
        # NOTE(int8): the portable path (another device, or no native kernels) computes the
        # same formulas in float32; the integer dot products of W8A8 are exact in float32
        # while |acc| < 2^24 (K up to ~1000 at full scale), close beyond.
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.quantize_activations:
            xq, xs = quantize_activations_per_token(x2)
            y = F.linear(xq.to(torch.float32), layer.weight.to(torch.float32))
            y = y * xs[:, None] * layer.weight_scale
        else:
            y = F.linear(x2.to(torch.float32), layer.weight.to(torch.float32))
            y = y * layer.weight_scale
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.view(*x.shape[:-1], -1).to(x.dtype)
