"""Which layers of a loaded model keep the batch-invariant mode (`batch_invariant=True`).

In that mode every token's floats must depend on the token and its context alone: no kernel may
sum a row in an order that changes with the number of rows of the step, and attention must not
change its reduction order with the batch, the chunking or a prefix-cache hit. The check runs
once after loading, so a model the kernels cannot serve that way is refused at start-up with
the layer named, rather than giving outputs that silently vary.

What keeps it (docs/architecture.md, "Batch-invariant mode"): float linears on the CPU's packed
GEMM, GGUF and W8A8 linears on their 8-bit-activation kernels, a packed or GGUF-quantized LM
head, and the `cpu_paged` attention backend over a float32 / bfloat16 / int8 / fp8 cache (its
per-token path). What does not, yet: mixture-of-experts layers, weight-only int8, unpacked float
weights (`PAGEDLLM_CPU_PACKED_GEMM=0`), GGUF on float activations
(`PAGEDLLM_GGUF_Q8_ACTIVATIONS=0`), other attention backends (CUDA, torch_sdpa).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backends.cpu_paged import KERNEL_CACHE_DTYPES
from pagedllm.layers.attention import Attention
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.vocab_embedding import LMHead



def batch_invariance_problems(model: nn.Module, kv_cache_dtype: torch.dtype) -> list[str]:
    """The layers of `model` (by module name) that would break the batch-invariant mode, each
    with the reason; [] when the model keeps it. `kv_cache_dtype` is the engine's resolved
    KV cache dtype."""
    problems = []
    if kv_cache_dtype not in KERNEL_CACHE_DTYPES:
        problems.append(f"kv_cache_dtype {kv_cache_dtype}: attention then runs torch SDPA, "
                        f"whose reduction order follows the batch")
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            problems.append(f"{name}: mixture-of-experts layers (an expert's GEMM tiles change "
                            f"with the number of tokens routed to it)")
        elif isinstance(module, Attention):
            if module.backend.name != "cpu_paged":
                problems.append(f"{name}: attention backend {module.backend.name!r} (only "
                                f"cpu_paged has a batch-invariant path)")
        elif isinstance(module, LMHead):
            method = module.quant_method
            if not (module.packed if method is None else method.batch_invariant(module)):
                problems.append(f"{name}: an LM head outside the packed GEMM and the GGUF "
                                f"8-bit-activation kernels")
        else:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "apply") \
                    and not method.batch_invariant(module):
                problems.append(f"{name}: {type(method).__name__} (its kernel sums a batch-1 "
                                f"row in another order than a batch's)")
    return problems


def check_batch_invariance(model: nn.Module, kv_cache_dtype: torch.dtype) -> None:
    """Raise if `model` cannot run in the batch-invariant mode.

    Raises:
        ValueError: naming the first few layers that cannot (`batch_invariance_problems`) and
            what to change.
    """
    problems = batch_invariance_problems(model, kv_cache_dtype)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more"
                                           if len(problems) > 3 else "")
        raise ValueError(f"batch_invariant=True is not available for this model here: {shown}. "
                         f"Supported: dense models on the CPU with float (packed), GGUF "
                         f"(8-bit activations, the default) or w8a8 weights")
