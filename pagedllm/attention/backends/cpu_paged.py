"""Paged attention for the CPU with a native kernel that reads the KV cache in place.

Per step the requests are split in two:

- requests whose whole sequence is new this step (a first prefill chunk with no cached prefix):
  their keys are exactly the new keys, so they go to torch's SDPA (flash attention on the CPU)
  directly on the new q/k/v, one call per request, nothing read from the cache;
- every other request (decodes, later prefill chunks, prefix-cache hits): the C++ kernel in
  `pagedllm/native/kernels/csrc/cpu_attention.cpp`, which walks the request's block table and reads K/V
  rows where they lie, with a block-wise online softmax. Decodes are parallel over (query token,
  KV heads); a request with several query tokens over (tile of up to 16 query tokens, KV heads),
  so each K/V block is read once per tile rather than once per token (the same floats;
  docs/benchmarks.md, "Query-tiled CPU paged attention"); a request with 16 or more (a later
  prefill chunk) over 64-token tiles computed as register-blocked GEMMs per 64-key chunk (the
  same up to float32 rounding).

Compared with `torch_sdpa` this removes the gather of each request's context into a padded copy
(read + write + read of the whole KV per layer), and the padding of a decode batch to its longest
sequence. The KV cache may be float32, bfloat16, int8 or float8_e4m3fn (kv_cache_dtype; the kernel
dequantizes in its inner loop, see kv_cache_layout.py); for another dtype (float16) the backend falls
back to `torch_sdpa` for the step.

In the batch-invariant mode (`CommonAttentionMetadata.batch_invariant`) every request goes to
the kernel's per-token path (`query_tile` 1, no SDPA and no tiles), where each token's floats
depend only on its own context: a long context is split at fixed positions (every 256 keys), the
same for a decode and for a token inside a prefill chunk.

A step with `CommonAttentionMetadata.attend_until` (Gemma 3's image tokens attending to each
other bidirectionally; only prefill steps that hold image tokens carry it) stays on this
backend: the kernel takes each query's horizon from it, and a fresh request holding image tokens
moves to the kernel (SDPA's `is_causal` cannot express the mask; SDPA with a boolean mask was
measured no faster than the kernel there, docs/multimodal.md).

Per-layer attention variants (Gemma): a sliding window and attention-logit soft-capping are
arguments of the kernel. A fresh request stays on SDPA only where SDPA computes the same thing:
no soft-capping, and a window (if any) that covers its whole sequence; otherwise the kernel takes
it too (it reads only the window's blocks). The split is computed once per step and variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.kv_cache_layout import write_kv_cache
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels.attention_ops import paged_attention


@dataclass
class CpuPagedMetadata:
    """Per-step inputs of the kernel, built once and shared by all layers.

    Attributes:
        common: the step's CommonAttentionMetadata.
        query_start_loc, seq_lens: [num_reqs + 1] / [num_reqs] int32 numpy (kernel inputs).
        kernel_rows: [R] int32 numpy, requests the kernel handles.
        all_rows: [num_reqs] int32 numpy, every request (the fused decoder path attends to all
            of them with the kernel).
        fresh_rows: requests whose sequence is entirely new this step (token range start, end).
        attend_until: the step's `attend_until` as a contiguous int64 CPU tensor (kernel
            input), or None.
    """

    common: CommonAttentionMetadata
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    kernel_rows: np.ndarray
    all_rows: np.ndarray
    fresh_rows: tuple[tuple[int, int], ...]
    attend_until: torch.Tensor | None = None
    _sdpa: TorchSDPAMetadata | None = field(default=None, repr=False)
    _splits: dict = field(default_factory=dict, repr=False)

    def sdpa_metadata(self) -> TorchSDPAMetadata:
        """The torch_sdpa metadata for the same step (built on first use, for the fallback)."""
        if self._sdpa is None:
            self._sdpa = TorchSDPABackend.build_metadata(self.common)
        return self._sdpa

    def split(self, sliding_window: int | None, soft_capped: bool
              ) -> tuple[np.ndarray, tuple[tuple[int, int], ...]]:
        """(kernel_rows, fresh_rows) for a layer with this window / soft-capping: fresh requests
        that SDPA cannot compute exactly (soft-capped, or longer than the window) move to the
        kernel. Cached per (window, soft_capped) for the step."""
        if sliding_window is None and not soft_capped:
            return self.kernel_rows, self.fresh_rows
        key = (sliding_window, soft_capped)
        if key not in self._splits:
            if soft_capped:
                moved = list(self.fresh_rows)
            else:
                moved = [(a, b) for a, b in self.fresh_rows if b - a > sliding_window]
            if not moved:
                self._splits[key] = self.kernel_rows, self.fresh_rows
            else:
                starts = self.query_start_loc[:-1]
                # The last request starting at `a` is the fresh one (it has tokens).
                moved_rows = np.searchsorted(starts, [a for a, _ in moved], side="right") - 1
                rows = np.sort(np.concatenate([self.kernel_rows, moved_rows])).astype(np.int32)
                kept = tuple(r for r in self.fresh_rows if r not in moved)
                self._splits[key] = rows, kept
        return self._splits[key]


# Cache dtypes the kernel reads (int8 / fp8 with their scales, see kv_cache_layout.py).
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


class CpuPagedBackend:
    """Paged attention on the CPU through the native kernel (needs `cpu_kernels()`)."""

    name = "cpu_paged"
    # Takes CommonAttentionMetadata.attend_until (in the kernel).
    supports_attend_until = True

    @staticmethod
    def is_available() -> bool:
        return cpu_kernels() is not None

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> CpuPagedMetadata:
        qsl = np.ascontiguousarray(common.query_start_loc_cpu[:common.num_reqs + 1],
                                   dtype=np.int32)
        seq_lens = np.ascontiguousarray(common.seq_lens_cpu[:common.num_reqs], dtype=np.int32)
        query_lens = qsl[1:] - qsl[:-1]
        fresh = (query_lens == seq_lens) & (query_lens > 1) & (not common.batch_invariant)
        attend_until = None
        if common.attend_until is not None and common.causal:
            attend_until = common.attend_until.to("cpu", torch.int64).contiguous()
            for r in np.nonzero(fresh)[0]:
                # A fresh request's positions are 0 .. L - 1; image tokens see further.
                until = attend_until[qsl[r]:qsl[r + 1]]
                fresh[r] = torch.equal(until, torch.arange(len(until)))
        kernel_rows = np.nonzero(~fresh)[0].astype(np.int32)
        fresh_rows = tuple((int(qsl[r]), int(qsl[r + 1])) for r in np.nonzero(fresh)[0])
        return CpuPagedMetadata(common=common, query_start_loc=qsl, seq_lens=seq_lens,
                                kernel_rows=kernel_rows,
                                all_rows=np.arange(common.num_reqs, dtype=np.int32),
                                fresh_rows=fresh_rows, attend_until=attend_until)

    @staticmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: CpuPagedMetadata, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """Write new K/V to the cache and attend.

        Args:
            query: [num_tokens, num_heads, head_size].
            key, value: [num_tokens, num_kv_heads, head_size] for the new tokens.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size], float32, bfloat16,
                or int8 / float8_e4m3fn with their scales (kv_cache_layout.py); other dtypes go through
                torch_sdpa.
            metadata: from `build_metadata`.
            scale: softmax scale (usually head_size ** -0.5).
            sliding_window: a query at position p attends only to key positions > p - window
                (HF's sliding-window mask); None = the whole causal context.
            logits_soft_cap: scores become cap * tanh(score / cap) before the softmax (Gemma 2);
                None = no capping.

        Returns:
            [num_tokens, num_heads, head_size] in query's dtype (padded tokens are zero).
        """
        if kv_cache.dtype not in KERNEL_CACHE_DTYPES:
            return TorchSDPABackend.forward(query, key, value, kv_cache,
                                            metadata.sdpa_metadata(), scale, sliding_window,
                                            logits_soft_cap)
        common = metadata.common
        n = common.num_actual_tokens
        num_heads = query.shape[1]
        num_kv_heads = kv_cache.shape[-2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # NOTE(kv_quant): with an int8/fp8 cache the fresh requests' SDPA takes the K/V as the
        # cache holds them (dequantized), so a request attends to the same values whether its
        # prefix was computed this step or hit in the prefix cache.
        key_new, value_new = write_kv_cache(kv_cache, key[:n], value[:n],
                                            common.slot_mapping[:n])

        out = torch.empty(query.shape, dtype=torch.float32)
        out[n:] = 0
        rep = num_heads // num_kv_heads
        rows, fresh_rows = metadata.split(sliding_window, logits_soft_cap is not None)
        for start, end in fresh_rows:
            # NOTE(perf): 4-D inputs: torch's CPU flash-attention kernel takes only [B, H, L, D];
            # 3-D ones fall back to the much slower math path (docs/benchmarks.md,
            # "Measurements behind choices in the code").
            q = query[start:end].transpose(0, 1)[None]                    # [1, H, L, D]
            k = key_new[start:end].transpose(0, 1)[None]                  # [1, KVH, L, D]
            v = value_new[start:end].transpose(0, 1)[None]
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=common.causal, scale=scale)
            out[start:end] = o[0].transpose(0, 1)

        if len(rows):
            paged_attention(query, kv_cache, common.block_table, metadata.query_start_loc,
                            metadata.seq_lens, rows, scale, common.causal, sliding_window,
                            logits_soft_cap, query_tile=1 if common.batch_invariant else None,
                            out=out, checked=False, attend_until=metadata.attend_until)
        return out if query.dtype == torch.float32 else out.to(query.dtype)
