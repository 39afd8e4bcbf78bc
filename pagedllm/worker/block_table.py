"""BlockTable: per-slot lists of KV block ids, and the slot_mapping computation.

    block_table[req_index] = [b0, b1, b2, ...]   (int32, [max_num_reqs, max_num_blocks_per_req])
    token at position p of that request lives in slot  block_table[req_index, p // block_size]
                                                        * block_size + p % block_size
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Block ids of each request slot (CPU numpy; copied to the device per step by the runner)."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row]
        end = start + len(block_ids)
        if end > self.block_table_np.shape[1]:
            raise ValueError(f"request slot {row} would hold {end} blocks, more than "
                             f"max_num_blocks_per_req={self.block_table_np.shape[1]}")
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def compute_slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """rows [n] (slot of each token's request), positions [n] -> slot ids [n] int64."""
        block_ids = self.block_table_np[rows, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size
