"""Row-wise argmax for the samplers."""

import torch


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value: x [B, V] float -> [B] int64 on x's device. Ties
    give the first index and a NaN counts as the largest value (the first NaN), both as
    `torch.argmax`.

    On the CPU, float32 rows go through numpy's argmax (vectorised, one thread), which is much
    faster than torch's for vocabulary-sized rows (docs/benchmarks.md, "Measurements behind
    choices in the code"): it is a greedy decode step's whole sampling cost.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)
