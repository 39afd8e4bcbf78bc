"""Paged attention with torch's scaled_dot_product_attention (portable reference backend).

New K/V are first written to their slots in the paged cache; then each request's queries attend
to its context gathered from the cache through its block table. Requests are batched in two
groups so SDPA runs once per group per layer, never per token:

    decode group  (query_len == 1):  q [G, KVH, rep, D]         x  K/V [G, KVH, S_max, D]
    prefill group (query_len  > 1):  q [G, KVH, rep * Q_max, D] x  K/V [G, KVH, S_max, D]

(rep = num_heads / num_kv_heads query heads share a KV head and are folded into the query axis)

with a boolean mask [G, 1, Q_max, S_max] allowing key position <= query position (causal, offset
by the cached context) and < seq_len; with `attend_until` (image tokens attended
bidirectionally) key position <= attend_until of the query instead. The gather indices and masks are built once per step in
`build_metadata` and shared by every layer; a layer with a sliding window (Gemma's local layers)
narrows its group masks to key position > query position - window, built on the first such
layer of the step and cached per window. A layer with attention-logit soft-capping (Gemma 2)
runs the same computation as explicit matmul / tanh / softmax, since SDPA has no hook between
the scores and the softmax. Padding exists only inside a group and is dropped before the output
is scattered back to the flat token order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.kv_cache_layout import dequantize_kv, write_kv_cache
from pagedllm.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class _RequestGroup:
    """Rows batched into one SDPA call.

    query_index: [G, Q_max] int64, flat token index of each (padded) query.
    kv_slots: [G, S_max] int64, cache slot of each (padded) key position.
    attn_mask: [G, 1, Q_max, S_max] bool, True = attend.
    valid: [G * Q_max] bool, which padded queries are real.
    out_index: [num_valid] int64, flat token index of each real query (in `valid` order).
    window_start: [G, 1, Q_max, 1] int64, position of each query + 1; a window W keeps key
        positions >= window_start - W. Padded queries hold 0 (their rows keep every key, so no
        row is fully masked).
    """

    query_index: torch.Tensor
    kv_slots: torch.Tensor
    attn_mask: torch.Tensor
    valid: torch.Tensor
    out_index: torch.Tensor
    window_start: torch.Tensor
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False,
                                                   compare=False)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """attn_mask, narrowed to the last `sliding_window` positions of each query when set
        (built once per window and step)."""
        if sliding_window is None:
            return self.attn_mask
        mask = self._window_masks.get(sliding_window)
        if mask is None:
            k_pos = torch.arange(self.attn_mask.shape[-1], device=self.attn_mask.device)
            mask = self.attn_mask & (k_pos >= self.window_start - sliding_window)
            self._window_masks[sliding_window] = mask
        return mask


@dataclass(frozen=True)
class TorchSDPAMetadata:
    common: CommonAttentionMetadata
    groups: tuple[_RequestGroup, ...]


def build_row_group(common: CommonAttentionMetadata, rows: np.ndarray) -> _RequestGroup:
    """One SDPA row group of the requests `rows` (int numpy indices, at least one): their
    queries and contexts padded to the group's longest, with the gather indices and the
    [G, 1, Q_max, S_max] mask described in the module docstring (built on the device of
    `common.seq_lens`). Shared with the MLA backends, which run their torch rows on it."""
    device = common.seq_lens.device
    qsl = common.query_start_loc_cpu
    query_lens = (qsl[1:] - qsl[:-1])[rows]
    seq_lens = common.seq_lens_cpu[rows]
    q_max, s_max = int(query_lens.max()), int(seq_lens.max())
    rows_t = torch.from_numpy(rows).to(device)
    q_lens_t = torch.from_numpy(query_lens.astype(np.int64)).to(device)
    seq_lens_t = common.seq_lens[rows_t].long()

    qi = torch.arange(q_max, device=device)
    valid_2d = qi[None, :] < q_lens_t[:, None]                                  # [G, Q_max]
    q_start = common.query_start_loc[rows_t].long()
    query_index = torch.where(valid_2d, q_start[:, None] + qi[None, :], 0)
    q_pos = (seq_lens_t - q_lens_t)[:, None] + qi[None, :]                      # [G, Q_max]

    kpos = torch.arange(s_max, device=device)
    kv_valid = kpos[None, :] < seq_lens_t[:, None]                              # [G, S_max]
    bs = common.block_size
    block_ids = common.block_table[rows_t][:, kpos // bs].long()                # [G, S_max]
    kv_slots = torch.where(kv_valid, block_ids * bs + kpos % bs, 0)
    mask = kv_valid[:, None, :].expand(-1, q_max, -1)                           # [G, Q_max, S_max]
    if common.causal:
        horizon = q_pos
        if common.attend_until is not None:
            horizon = torch.where(valid_2d, common.attend_until[query_index], q_pos)
        mask = mask & (kpos[None, None, :] <= horizon[:, :, None])
    valid = valid_2d.reshape(-1)
    window_start = torch.where(valid_2d, q_pos + 1, 0)[:, None, :, None]
    return _RequestGroup(query_index=query_index, kv_slots=kv_slots,
                         attn_mask=mask[:, None, :, :], valid=valid,
                         out_index=query_index.reshape(-1)[valid], window_start=window_start)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          scale: float, soft_cap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap), masked) v; q [G, KVH, Q, D], k/v [G, KVH, S, D],
    mask [G, 1, Q, S] bool (True = attend, no row fully False). Scores in float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


class TorchSDPABackend:
    """Reference paged attention on any device torch supports."""

    name = "torch_sdpa"
    # Takes CommonAttentionMetadata.attend_until (bidirectional image tokens).
    supports_attend_until = True

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        qsl = common.query_start_loc_cpu
        query_lens = qsl[1:] - qsl[:-1]
        is_decode = query_lens == 1
        groups = []
        for rows in (np.nonzero(is_decode)[0], np.nonzero(~is_decode)[0]):
            if len(rows):
                groups.append(build_row_group(common, rows))
        return TorchSDPAMetadata(common=common, groups=tuple(groups))

    @staticmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchSDPAMetadata, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """Write new K/V to the cache and attend.

        Args:
            query: [num_tokens, num_heads, head_size].
            key, value: [num_tokens, num_kv_heads, head_size] for the new tokens.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]; an int8/fp8 cache
                (kv_cache_layout.py) is quantized on write and dequantized after the gather.
            metadata: from `build_metadata`.
            scale: softmax scale (usually head_size ** -0.5).
            sliding_window: a query at position p attends only to key positions > p - window
                (HF's sliding-window mask); None = the whole causal context.
            logits_soft_cap: scores become cap * tanh(score / cap) before the softmax (Gemma 2);
                None = no capping.

        Returns:
            [num_tokens, num_heads, head_size] attention output (padded tokens are zero).
        """
        common = metadata.common
        n = common.num_actual_tokens
        num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
        write_kv_cache(kv_cache, key[:n], value[:n], common.slot_mapping[:n])

        out = torch.zeros_like(query)
        num_heads = query.shape[1]
        rep = num_heads // num_kv_heads
        for g in metadata.groups:
            num_rows, q_len = g.query_index.shape
            # NOTE(perf): grouped-query attention as plain attention: the `rep` query heads that
            # share a KV head are folded into the query-length axis ([G, KVH, rep * Q, D]).
            # torch's CPU SDPA with enable_gqa=True is far slower for decode queries
            # (docs/benchmarks.md, "Measurements behind choices in the code").
            q = query[g.query_index].view(num_rows, q_len, num_kv_heads, rep, head_size)
            q = q.permute(0, 2, 3, 1, 4).reshape(num_rows, num_kv_heads, rep * q_len, head_size)
            mask = g.mask(sliding_window)
            mask = mask if q_len == 1 else mask.repeat(1, 1, rep, 1)
            # NOTE(perf): index_select on flat slots is much faster than advanced indexing on
            # CPU (docs/benchmarks.md, "Measurements behind choices in the code").
            kv_shape = (num_rows, -1, num_kv_heads, head_size)
            flat_slots = g.kv_slots.reshape(-1)
            k = dequantize_kv(kv_cache, 0, flat_slots, q.dtype).view(kv_shape).transpose(1, 2)
            v = dequantize_kv(kv_cache, 1, flat_slots, q.dtype).view(kv_shape).transpose(
                1, 2)                                                 # [G, KVH, S, D]
            if logits_soft_cap is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            else:
                o = _softcapped_attention(q, k, v, mask, scale, logits_soft_cap)
            o = o.view(num_rows, num_kv_heads, rep, q_len, head_size).permute(0, 3, 1, 2, 4)
            o = o.reshape(-1, num_heads, head_size)                  # [G * Q, H, D]
            out[g.out_index] = o[g.valid]
        return out
