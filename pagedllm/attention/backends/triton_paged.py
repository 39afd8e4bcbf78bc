"""Paged attention with Triton kernels that read the KV cache in place (the CUDA default).

Per layer and step two launches, no gather and no per-request split:

1. `reshape_and_cache` writes the new tokens' K/V into their slots (`slot_mapping`, -1 = skip);
2. `unified_attention` attends for every query of the step at once, prefill chunks and decodes
   alike, walking each request's block table with an online softmax (FlashAttention-2), with the
   layer's sliding window and logit soft-capping (see `attention/ops/triton_unified_attention.py`).

Encoder-only steps (`causal=False`) run in the same kernel without the causal mask. A step with
`CommonAttentionMetadata.attend_until` (Gemma 3's image tokens attending to each other
bidirectionally) passes it to the kernel, which then takes each query's horizon from it. The kernels
need triton; this module imports them on first use, so it imports (and the selector can list the
backend) where triton is missing. On CPU tensors they run only in triton's interpreter, chosen
by `TRITON_INTERPRET=1` in the environment when triton and the kernel modules are imported (its
own `tl.sum`, `tl.zeros`, ... are decorated then); that is for tests.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from pagedllm.kv_cache_layout import is_quantized_kv_cache
from pagedllm.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class TritonPagedMetadata:
    """Per-step inputs of the kernels, shared by all layers.

    The kernels read everything from the step's CommonAttentionMetadata on the device
    (query_start_loc, seq_lens, block_table, slot_mapping); nothing is derived per step, so a
    decode step's launch has no host work beyond its arguments (CUDA graph friendly).
    """

    common: CommonAttentionMetadata


class TritonPagedBackend:
    """Paged attention through Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton_paged"
    # Launches depend only on device tensors and the (padded) sizes: decode steps may be
    # captured in CUDA graphs (worker/cuda_graph.py).
    supports_cuda_graphs = True
    # Takes CommonAttentionMetadata.attend_until (bidirectional image tokens) in the kernel.
    supports_attend_until = True

    @staticmethod
    def is_available() -> bool:
        return importlib.util.find_spec("triton") is not None

    @staticmethod
    def unavailable_reason() -> str:
        return "the `triton` package is not installed (pip install triton)"

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> TritonPagedMetadata:
        return TritonPagedMetadata(common=common)

    @staticmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TritonPagedMetadata, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """Write new K/V to the cache and attend.

        Args:
            query: [num_tokens, num_heads, head_size].
            key, value: [num_tokens, num_kv_heads, head_size] for the new tokens.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size], fp32/fp16/bf16.
            metadata: from `build_metadata`.
            scale: softmax scale (usually head_size ** -0.5).
            sliding_window: a query at position p attends only to key positions > p - window
                (HF's sliding-window mask); None = the whole causal context.
            logits_soft_cap: scores become cap * tanh(score / cap) before the softmax (Gemma 2);
                None = no capping.

        Returns:
            [num_tokens, num_heads, head_size] in query's dtype (padded tokens are zero).

        Raises:
            ValueError: for CPU tensors when the kernels were not imported under
                TRITON_INTERPRET=1, an int8/fp8 KV cache (not supported yet), or inputs the
                kernels do not take (see `unified_attention`).
        """
        from pagedllm.attention.ops import triton_reshape_and_cache, triton_unified_attention

        if is_quantized_kv_cache(kv_cache):
            # TODO(#22): int8/fp8 K/V in the Triton kernels (dequantize in the inner loop).
            raise ValueError(f"triton_paged: kv_cache_dtype with a {kv_cache.dtype} KV cache is "
                             "not supported yet; use kv_cache_dtype='auto' on CUDA (int8/fp8 KV "
                             "caches run on the CPU backends)")
        if query.device.type == "cpu" and not (triton_unified_attention.INTERPRETED
                                               and triton_reshape_and_cache.INTERPRETED):
            raise ValueError("triton_paged: CPU tensors need triton's interpreter "
                             "(TRITON_INTERPRET=1 set before triton is imported); use cpu_paged "
                             "or torch_sdpa on the CPU")
        common = metadata.common
        n = common.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        triton_reshape_and_cache.reshape_and_cache(key[:n], value[:n], key_cache, value_cache,
                                                   common.slot_mapping[:n])
        out = torch.empty_like(query)
        out[n:].zero_()
        triton_unified_attention.unified_attention(
            query, key_cache, value_cache, out, common.query_start_loc[:common.num_reqs + 1],
            common.seq_lens[:common.num_reqs], common.block_table, n, common.max_query_len,
            scale, causal=common.causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            attend_until=common.attend_until if common.causal else None)
        return out
