"""CommonAttentionMetadata: the per-step facts every attention backend starts from.

Tokens of all scheduled requests are flattened into one batch (no padding to a rectangle):

    request:          r0          r1     r2
    tokens:      [t t t t t]   [t t t]   [t]        num_actual_tokens = 9
    query_start_loc = [0, 5, 8, 9]                  (int32, [num_reqs + 1])
    seq_lens        = [ctx0 + 5, ctx1 + 3, ctx2 + 1] (int32, [num_reqs]; ctx = num_computed_tokens)

Query i of request r sits at position `seq_lens[r] - query_len[r] + i` and attends to positions
`[0, that position]` of the same request, read through `block_table[r]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """Per-step attention inputs shared by all layers.

    Attributes:
        query_start_loc: [num_reqs + 1] int32 on the device, cumulative query lengths.
        query_start_loc_cpu: the same as a numpy array.
        seq_lens: [num_reqs] int32 on the device, context + query length per request.
        seq_lens_cpu: the same as a numpy array.
        block_table: [num_reqs, max_num_blocks] int32 on the device.
        slot_mapping: [num_actual_tokens] int64 on the device, KV slot of each new token
            (`block_id * block_size + offset`; -1 = do not write).
        num_reqs, num_actual_tokens, max_query_len, max_seq_len: ints.
        block_size: tokens per KV block.
        causal: False for encoder-only models.
        attend_until: [num_actual_tokens] int64 on the device, the last key position each
            query may attend (its own position, except for the tokens of an image a model
            attends bidirectionally, e.g. Gemma 3: the image's last position); None = causal.
            Only backends with `supports_attend_until` take it.
        batch_invariant: the engine's batch-invariant mode (`batch_invariant=True`): a backend
            must then compute each query token's output from that token's own context alone,
            in a reduction order that does not depend on the other requests of the step, on
            how its prompt was chunked, or on whether its prefix came from the cache.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: np.ndarray
    seq_lens: torch.Tensor
    seq_lens_cpu: np.ndarray
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    causal: bool = True
    batch_invariant: bool = False
    attend_until: torch.Tensor | None = None

    def token_seq_lens(self) -> np.ndarray:
        """[num_actual_tokens] int32: each token's request's `seq_lens` entry."""
        qsl = self.query_start_loc_cpu[:self.num_reqs + 1]
        return np.repeat(self.seq_lens_cpu[:self.num_reqs], np.diff(qsl))


@dataclass(frozen=True)
class KVCacheGroupsMetadata:
    """The forward context's metadata for a model whose layers use several KV cache groups
    (core/kv_cache_groups.py): one backend metadata per group, each built from that group's
    CommonAttentionMetadata (its own block table and slot mapping; the token layout, query
    starts and sequence lengths are the same). A layer attends with the metadata of the group of
    its sliding window. With a single group the forward context holds the backend's metadata
    itself and this class is not used.

    Attributes:
        sliding_windows: [num_groups] each group's window (None = full attention).
        group_metadata: [num_groups] the backend metadata of each group.
        common: group 0's CommonAttentionMetadata (step facts for readers such as RoPE scaling).
    """

    sliding_windows: tuple[int | None, ...]
    group_metadata: tuple[object, ...]
    common: CommonAttentionMetadata

    def for_layer(self, sliding_window: int | None) -> object:
        """The metadata of the group of layers with this window.

        Raises:
            KeyError: if no group has this window.
        """
        try:
            return self.group_metadata[self.sliding_windows.index(sliding_window)]
        except ValueError:
            raise KeyError(f"no KV cache group for sliding window {sliding_window} (groups: "
                           f"{self.sliding_windows})") from None
