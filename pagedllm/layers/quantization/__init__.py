"""Quantization methods of linear layers (DESIGN §8): `UnquantizedLinearMethod` (float
weights) and `GGUFLinearMethod` (GGUF blocks kept in memory, native CPU kernels).

`quantize_linear_layers(model, method_name)` swaps every linear layer's method before loading
(gpt-fast's module swap: the models stay free of quantization).
"""

from __future__ import annotations

from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod

QUANTIZATION_METHODS = ("none", "gguf")


def get_linear_method(name: str) -> LinearMethodBase:
    """A fresh method object for `name` in QUANTIZATION_METHODS.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name == "none":
        return UnquantizedLinearMethod()
    if name == "gguf":
        from pagedllm.layers.quantization.gguf import GGUFLinearMethod
        return GGUFLinearMethod()
    raise ValueError(f"unknown quantization {name!r}; known: {', '.join(QUANTIZATION_METHODS)}")


def quantize_linear_layers(model: nn.Module, name: str) -> int:
    """Give every linear layer of `model` (those with `set_quant_method`, layers/linear.py) a
    new `name` method; its weight is re-created empty, to be loaded afterwards.

    Returns:
        The number of layers changed.

    Raises:
        ValueError: an unknown name, or a layer's shard the method cannot store.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "set_quant_method"):
            module.set_quant_method(get_linear_method(name))
            count += 1
    return count


__all__ = ["LinearMethodBase", "QUANTIZATION_METHODS", "UnquantizedLinearMethod",
           "get_linear_method", "quantize_linear_layers"]
