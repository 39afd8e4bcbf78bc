"""The quantization method of a linear layer (vLLM's `LinearMethodBase` pattern) and the
unquantized one.

A linear layer (`layers/linear.py`) owns a method object that creates its weight parameter,
copies checkpoint tensors into it and computes y = x W^T + b from it. The layer keeps the TP
logic (which rows of which checkpoint tensor go where); the method knows only the storage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagedllm.platforms import current_platform


class LinearMethodBase(ABC):
    """How one linear layer stores and applies its weight.

    Attributes:
        quantized: the weight is not a plain float [out, in] matrix (the fused CPU decoder and
            other code that reads `layer.weight` as a matrix must not take such a layer).
    """

    quantized: bool = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_size_per_partition: int, weight_loader) -> None:
        """Register `layer.weight` for this rank's [output, input] shard (any earlier weight is
        replaced); `weight_loader` becomes the parameter's `weight_loader`.

        Raises:
            ValueError: a shard this method cannot store (naming the sizes).
        """

    @abstractmethod
    def load_weight(self, layer: nn.Module, loaded, row_offset: int | None) -> None:
        """Copy a checkpoint tensor, already narrowed to this rank's shard, into rows
        [row_offset, row_offset + loaded.shape[0]) of `layer.weight` (None: the whole weight).

        `loaded` is a torch tensor or a lazy checkpoint tensor (`shape`, `narrow`,
        `materialize`, and for GGUF `tensor_type`, `materialize_raw`).

        Raises:
            ValueError: a shape or format mismatch, naming both sides.
        """

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T + bias for x [..., input_size_per_partition]; returns
        [..., output_size_per_partition] in x's dtype."""

    def batch_invariant(self, layer: nn.Module) -> bool:
        """Whether `apply` computes each row of x in the same order of sums whatever the
        number of rows (the batch-invariant mode needs it; docs/architecture.md). False unless
        a method's kernels are known to."""
        return False


def copy_checkpoint_tensor(param: torch.Tensor, loaded) -> None:
    """Copy a whole checkpoint tensor (a torch tensor or a lazy one, read here) into `param`.

    Raises:
        ValueError: on a shape mismatch, naming both shapes.
    """
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded.materialize())


class UnquantizedLinearMethod(LinearMethodBase):
    """A float weight [output_size_per_partition, input_size_per_partition] in the default
    dtype, applied with the platform's linear (`current_platform.linear`).

    After loading (`process_weights_after_loading`) the platform may repack the weight for its
    packed GEMM (CPU: `csrc/packed_gemm.h` panels): `layer.weight` keeps its shape and dtype
    but its storage is then in that layout (`packed` is True) and only `apply` /
    `current_platform.packed_linear` (and the fused CPU decoder, told by the flag) may read
    it; `unpacked_weight` gives the [out, in] matrix back, and loading into a packed weight
    unpacks it first.

    Attributes:
        packed: `layer.weight` holds the platform's packed layout.
    """

    def __init__(self) -> None:
        self.packed = False

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_size_per_partition: int, weight_loader) -> None:
        weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition),
                              requires_grad=False)
        weight.weight_loader = weight_loader
        layer.weight = weight
        self.packed = False

    def load_weight(self, layer: nn.Module, loaded, row_offset: int | None) -> None:
        if self.packed:   # a reload: rows go into the [out, in] matrix (repacked after loading)
            layer.weight.data = self.unpacked_weight(layer)
            self.packed = False
        dst = layer.weight if row_offset is None else layer.weight.data.narrow(
            0, row_offset, loaded.shape[0])
        copy_checkpoint_tensor(dst, loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Replace `layer.weight`'s storage by the platform's packed layout where it has one
        (`current_platform.pack_linear_weight`; the parameter object, shape and dtype stay, and
        the unpacked storage is freed, so memory does not grow). Idempotent."""
        if self.packed:
            return
        packed = current_platform.pack_linear_weight(layer.weight.data)
        if packed is not None:
            layer.weight.data = packed
            self.packed = True

    def batch_invariant(self, layer: nn.Module) -> bool:
        """The packed GEMM sums every output over k from 0 in one chain (its row tiles only
        group rows); the unpacked paths (the dot-product kernel's batch-1 GEMV, torch's GEMM
        beyond a row count) do not."""
        return self.packed

    def unpacked_weight(self, layer: nn.Module) -> torch.Tensor:
        """`layer.weight` as the [out, in] matrix (a new tensor when packed, else the data)."""
        if not self.packed:
            return layer.weight.data
        return current_platform.unpack_linear_weight(layer.weight.data)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            return current_platform.packed_linear(x, layer.weight, bias)
        return current_platform.linear(x, layer.weight, bias)


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every layer's quantization method the chance to convert its loaded weight
    (`process_weights_after_loading(layer)`, vLLM's hook; e.g. the CPU's packed GEMM layout).
    Called by the model loader once all checkpoint tensors are in."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        elif method is None and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()   # a module's own (the float LM head)
