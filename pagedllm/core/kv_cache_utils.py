"""Block hashing for prefix caching, and KV-cache size arithmetic.

A full block's hash is SHA-256 over (parent block's hash, the block's token ids, extra keys).
We use a cryptographic hash rather than Python's `hash()` because a collision would silently serve
another prompt's KV: with SHA-256 the chance is ~2^-128 per pair, far below hardware error rates.
Chaining the parent hash makes a block's hash identify the whole prefix, not just its own tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.multimodal.inputs import mm_block_keys

if TYPE_CHECKING:
    from pagedllm.core.request import Request

# The parent of a request's first block. Fixed so equal prompts hash equally across processes.
NONE_HASH = hashlib.sha256(b"pagedllm-prefix-cache-root").digest()


def hash_block_tokens(parent_block_hash: bytes, block_token_ids: list[int] | np.ndarray,
                      extra_keys: tuple = ()) -> bytes:
    """Hash one full block of tokens.

    Args:
        parent_block_hash: 32-byte hash of the previous block (NONE_HASH for the first block).
        block_token_ids: the block's `block_size` token ids.
        extra_keys: anything else that changes the KV of these tokens (e.g. a LoRA or multimodal
            id); included via its repr, so it must have a stable repr.

    Returns:
        32-byte SHA-256 digest.
    """
    h = hashlib.sha256(parent_block_hash)
    h.update(np.asarray(block_token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def get_request_block_hasher(block_size: int,
                             extra_keys: tuple = ()) -> Callable[[Request], list[bytes]]:
    """Return a function giving the hashes of a request's not-yet-hashed full blocks.

    A block over tokens of a prompt's image placeholders also hashes the image's identifier
    (`mm_block_keys`): the same text with another image never hits, the same image does.
    """

    def hasher(request: Request) -> list[bytes]:
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else NONE_HASH
        new_hashes = []
        tokens = request.all_token_ids
        while start + block_size <= len(tokens):
            keys = extra_keys
            if request.mm_features:
                keys = extra_keys + mm_block_keys(request.mm_features, start, start + block_size)
            parent = hash_block_tokens(parent, tokens[start:start + block_size], keys)
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return hasher


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int,
                             head_size: int, dtype_bytes: int) -> int:
    """Bytes one block takes over all layers (K and V)."""
    return 2 * num_layers * block_size * num_kv_heads * head_size * dtype_bytes


def num_blocks_from_bytes(kv_cache_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in `kv_cache_bytes`."""
    return kv_cache_bytes // bytes_per_block
