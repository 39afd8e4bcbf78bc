"""Quantization methods of linear layers: `UnquantizedLinearMethod` (float
weights), `GGUFLinearMethod` (GGUF blocks kept in memory, native CPU kernels), plus
`GGUFEmbeddingMethod` for a token embedding / LM head kept in GGUF blocks, and
`Int8LinearMethod` (float checkpoints quantized to per-channel int8 at load: "int8" weight-only,
"w8a8" with per-token int8 activations).

`quantize_linear_layers(model, method_name)` swaps every linear layer's method before loading
(gpt-fast's module swap: the models stay free of quantization).
"""

from __future__ import annotations

from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod

QUANTIZATION_METHODS = ("none", "gguf", "int8", "w8a8")


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
    if name in ("int8", "w8a8"):
        from pagedllm.layers.quantization.int8 import Int8LinearMethod
        return Int8LinearMethod(quantize_activations=name == "w8a8")
    raise ValueError(f"unknown quantization {name!r}; known: {', '.join(QUANTIZATION_METHODS)}")


def quantize_linear_layers(model: nn.Module, name: str) -> int:
    """Give every linear layer of `model` (those with `set_quant_method`, layers/linear.py) a
    new `name` method; its weight is re-created empty, to be loaded afterwards. With "gguf",
    token embeddings and LM heads (`set_embedding_method`, layers/vocab_embedding.py) and
    fused-MoE experts (`set_expert_method`, layers/quantization/gguf_moe.py) keep their blocks
    too; modules sharing one weight (a tied LM head) share one method.

    Returns:
        The number of layers changed.

    Raises:
        ValueError: an unknown name, or a layer's shard the method cannot store.
    """
    count = 0
    embedding_methods: dict[int, tuple] = {}   # id(old weight) -> (method, new weight)
    for module in model.modules():
        if hasattr(module, "set_quant_method"):
            module.set_quant_method(get_linear_method(name))
            count += 1
        elif hasattr(module, "set_expert_method") and name == "gguf":
            from pagedllm.layers.quantization.gguf_moe import GGUFMoEMethod
            module.set_expert_method(GGUFMoEMethod())
            count += 1
        elif hasattr(module, "set_embedding_method") and name == "gguf":
            key = id(module.weight)
            if key in embedding_methods:
                module.tie_embedding_method(*embedding_methods[key])
                count += 1
                continue
            from pagedllm.layers.quantization.gguf import GGUFEmbeddingMethod
            method = GGUFEmbeddingMethod()
            if module.set_embedding_method(method):
                embedding_methods[key] = (method, module.weight)
                count += 1
    return count


__all__ = ["LinearMethodBase", "QUANTIZATION_METHODS", "UnquantizedLinearMethod",
           "get_linear_method", "quantize_linear_layers"]
