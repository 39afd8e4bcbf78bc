"""Linear layers whose weights stay in a GGUF file's block format (llama.cpp's Q8_0, Q4_0, Q4_1).

    GGUF file ──(GGUFTensor.materialize_raw: rows of blocks, TP slice)──► layer.weight
        [output_size_per_partition, input_size_per_partition / 32 * block_bytes] uint8
    apply: gguf_linear (pagedllm/kernels/csrc/cpu_gguf_linear.cpp) unpacks blocks in registers

Blocks run along the input dimension, so splitting the output rows across tensor-parallel ranks
is exact, and splitting the input dimension must fall on block boundaries (refused otherwise).
The weight's type is learnt from the first checkpoint tensor loaded into it (the parameter is
created uninitialized); a fused layer (qkv, gate_up) needs one type for all its tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.ops import GGUF_BLOCK_SIZE, GGUF_KERNEL_TYPES, gguf_linear
from pagedllm.layers.quantization.base import LinearMethodBase


class GGUFLayoutUnsupported(ValueError):
    """A GGUF checkpoint's linear weights cannot stay quantized (a tensor type without a kernel,
    or a fused layer mixing types); the checkpoint still loads dequantized."""


class GGUFLinearMethod(LinearMethodBase):
    """Keeps a linear layer's weight as raw GGUF blocks and computes on them natively (CPU).

    After loading, `layer.weight` is [output_size_per_partition, row_bytes] uint8 and
    `layer.gguf_quant_type` its GGML type name; the bias (if any) stays float.
    """

    quantized = True

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_size_per_partition: int, weight_loader) -> None:
        if input_size_per_partition % GGUF_BLOCK_SIZE:
            raise ValueError(
                f"{type(layer).__name__}: an input shard of {input_size_per_partition} columns "
                f"does not fall on {GGUF_BLOCK_SIZE}-weight GGUF block boundaries (with tensor "
                f"parallelism, the row-parallel input split must); use quantization='none' or "
                f"another tensor_parallel_size")
        device = layer.weight.device if isinstance(getattr(layer, "weight", None),
                                                   torch.Tensor) else None
        weight = nn.UninitializedParameter(requires_grad=False, device=device)
        weight.weight_loader = weight_loader
        layer.weight = weight
        layer.gguf_quant_type = None
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = output_size_per_partition

    def load_weight(self, layer: nn.Module, loaded, row_offset: int | None) -> None:
        tensor_type = getattr(loaded, "tensor_type", None)
        name = getattr(loaded, "name", "?")
        if tensor_type is None or not hasattr(loaded, "materialize_raw"):
            raise ValueError(f"{type(layer).__name__} with GGUF quantization takes GGUF "
                             f"checkpoint tensors, got {type(loaded).__name__}")
        if tensor_type not in GGUF_KERNEL_TYPES:
            raise GGUFLayoutUnsupported(
                f"GGUF tensor {name} is {tensor_type}; quantized linear layers take "
                f"{', '.join(GGUF_KERNEL_TYPES)} (use quantization='none' to dequantize)")
        rows = loaded.shape[0]
        if tuple(loaded.shape[1:]) != (layer.input_size_per_partition,):
            raise ValueError(f"shape mismatch: GGUF tensor {name} {tuple(loaded.shape)} vs a "
                             f"shard of {layer.input_size_per_partition} input columns")
        weight = layer.weight
        if isinstance(weight, nn.UninitializedParameter):
            row_bytes = (layer.input_size_per_partition // GGUF_BLOCK_SIZE
                         * GGUF_KERNEL_TYPES[tensor_type][1])
            weight.materialize((layer.output_size_per_partition, row_bytes), dtype=torch.uint8)
            layer.gguf_quant_type = tensor_type
        elif layer.gguf_quant_type != tensor_type:
            raise GGUFLayoutUnsupported(
                f"{type(layer).__name__} fuses tensors of types {layer.gguf_quant_type} and "
                f"{tensor_type} (GGUF tensor {name}); one quantized weight needs one type "
                f"(use quantization='none' to dequantize)")
        start = 0 if row_offset is None else row_offset
        if row_offset is None and rows != layer.output_size_per_partition or \
                start + rows > layer.output_size_per_partition:
            raise ValueError(f"shape mismatch: GGUF tensor {name} has {rows} rows for rows "
                             f"[{start}, {start + rows}) of a {layer.output_size_per_partition}"
                             f"-row weight")
        weight.data.narrow(0, start, rows).copy_(loaded.materialize_raw())

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_linear(x, layer.weight, layer.gguf_quant_type, bias)
