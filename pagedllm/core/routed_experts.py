"""Routed experts of one request, as the scheduler collects them (plain numpy, no torch).

Routed-experts capture (`enable_return_routed_experts`, vLLM's; RL "routing replay") returns,
for every token a request's forward passes computed, the experts each MoE layer's router chose:

    routed_experts [num_tokens - 1, num_moe_layers, top_k]   (prompt tokens, then outputs)
                    ^ position p: the routing of the forward whose input was token p

The last token (the final output) is never an input, so it has no routing (vLLM's shape).
The worker sends, each step, the rows of the positions it computed for a request
(`ModelRunnerOutput.routed_experts`: first position, rows); the scheduler passes them on at
once with that step's delta (`EngineCoreOutput.new_routed_experts`, as `RoutedExperts`), and
the front end's `RoutedExpertsRecord` writes them at those positions, so positions computed
again (after preemption, or a rejected draft's position) are overwritten, never appended
twice. Positions nobody sent stay -1. Because the rows reach the front end with the tokens
they belong to, a request that a stop string ends there (and that the front end then aborts
in the core) still has every row its returned tokens need; nothing waits for the core.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Expert ids travel as int16 (fewer than 32,768 routed experts per layer: checked where the
# capture is set up, worker/routed_experts.py); -1 marks a position without routing.
ROUTED_EXPERTS_DTYPE = np.int16
NO_EXPERT = -1


@dataclass
class RoutedExperts:
    """Routing rows on their way from the core to the front end (msgpack-safe).

    Attributes:
        shape: [num_positions, num_moe_layers, top_k].
        data: the array's bytes, int16 little-endian, C order.
    """

    shape: list[int]
    data: bytes

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> RoutedExperts:
        return cls(list(array.shape), np.ascontiguousarray(array, dtype="<i2").tobytes())

    def to_numpy(self) -> np.ndarray:
        """[num_positions, num_moe_layers, top_k] int16, a read-only view of `data`.

        Raises:
            ValueError: when the bytes do not fill the shape.
        """
        array = np.frombuffer(self.data, dtype="<i2")
        if len(self.shape) != 3 or array.size != int(np.prod(self.shape)):
            raise ValueError(f"routed experts of shape {self.shape} do not match "
                             f"{array.size} values")
        return array.reshape(self.shape)


class RoutedExpertsRecord:
    """One request's routing rows by position, grown as positions arrive (kept by the front
    end's OutputProcessor).

    `write(start, rows)`: rows [m, num_moe_layers, top_k] (int16 values) of positions
    [start, start + m). `result(num_positions)`: the first `num_positions` rows as int32 (-1
    where none arrived).
    """

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None     # [capacity, num_moe_layers, top_k] int16

    def write(self, start: int, rows: np.ndarray) -> None:
        end = start + rows.shape[0]
        if self._rows is None:
            self._rows = np.full((max(end, 16),) + rows.shape[1:], NO_EXPERT,
                                 dtype=ROUTED_EXPERTS_DTYPE)
        elif end > self._rows.shape[0]:
            grown = np.full((max(end, 2 * self._rows.shape[0]),) + self._rows.shape[1:],
                            NO_EXPERT, dtype=ROUTED_EXPERTS_DTYPE)
            grown[:self._rows.shape[0]] = self._rows
            self._rows = grown
        self._rows[start:end] = rows

    def result(self, num_positions: int) -> np.ndarray | None:
        """[num_positions, num_moe_layers, top_k] int32 (vLLM's dtype), a fresh array: the rows
        of positions [0, num_positions); None when nothing was written."""
        if self._rows is None:
            return None
        rows = np.full((num_positions,) + self._rows.shape[1:], NO_EXPERT, dtype=np.int32)
        kept = min(num_positions, self._rows.shape[0])
        rows[:kept] = self._rows[:kept]
        return rows
