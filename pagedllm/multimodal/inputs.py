"""MultiModalFeature: one image of a prompt as the scheduler and the worker see it.

A plain dataclass of ints, strings and numpy arrays (it crosses process boundaries). The
prompt's token ids already hold the image's expanded placeholder tokens; the feature says where
they are and what the encoder needs to compute their embeddings:

    prompt tokens:   ... text | <fake><row_1_col_1><image>*k <fake><row_1_col_2><image>*k ... | text
                            offset ^                                                  offset + length ^
    is_embed:              [ 0     0          1 ... 1    0     0          1 ... 1   ... ]

The i-th True position of `is_embed` takes the i-th row of the encoder's output for the image.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class MultiModalFeature:
    """One image of one prompt.

    Attributes:
        modality: "image".
        identifier: hex SHA-256 of the image's encoder inputs (its `mm_hash`): equal images
            share encoder-cache entries and prefix-cache blocks, different ones never do.
        offset: index of the first prompt token of the image's placeholder range.
        length: tokens in the range [offset, offset + length).
        is_embed: bool [length]: which tokens of the range take an image embedding (the others,
            e.g. Idefics3's tile separators, keep their token embedding).
        data: the encoder's inputs (e.g. "pixel_values" float32 [num_tiles, 3, H, W]).
        bidirectional: the decoder attends the range's tokens to each other in both directions
            (Gemma 3): the range is then computed in one step, never split across chunks.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    is_embed: np.ndarray
    data: dict[str, np.ndarray]
    bidirectional: bool = False

    @property
    def num_embeds(self) -> int:
        """Embeddings the encoder produces for this image (= True entries of `is_embed`)."""
        return int(self.is_embed.sum())

    def embed_range(self, start: int, end: int) -> tuple[np.ndarray, int, int]:
        """The image's part of prompt positions [start, end): (positions relative to `start`
        that take embeddings, int64; first and one-past-last row of the encoder output they
        take). Empty when the range does not overlap the image."""
        lo, hi = max(start, self.offset), min(end, self.offset + self.length)
        if lo >= hi:
            return np.zeros(0, dtype=np.int64), 0, 0
        before = int(self.is_embed[:lo - self.offset].sum())
        mask = self.is_embed[lo - self.offset:hi - self.offset]
        positions = np.nonzero(mask)[0].astype(np.int64) + (lo - start)
        return positions, before, before + len(positions)


def mm_block_keys(features: list[MultiModalFeature], start: int, end: int) -> tuple[str, ...]:
    """Identifiers of the images whose placeholder ranges overlap tokens [start, end): the extra
    keys of a prefix-cache block over those tokens (same text + another image never hits)."""
    return tuple(f.identifier for f in features
                 if f.offset < end and f.offset + f.length > start)
