"""`current_platform`: the one place that decides which device the engine runs on.

CUDA when torch sees a GPU, the CPU otherwise; `PAGEDLLM_DEVICE=cpu` forces the CPU.
"""

from __future__ import annotations

import os

import torch

from pagedllm.platforms.interface import Platform


def _detect() -> Platform:
    forced = os.environ.get("PAGEDLLM_DEVICE", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"PAGEDLLM_DEVICE must be 'cpu' or 'cuda', got {forced!r}")
    if forced != "cpu" and torch.cuda.is_available():
        from pagedllm.platforms.cuda import CudaPlatform
        return CudaPlatform()
    if forced == "cuda":
        raise RuntimeError("PAGEDLLM_DEVICE=cuda but torch sees no CUDA device")
    from pagedllm.platforms.cpu import CpuPlatform
    return CpuPlatform()


current_platform: Platform = _detect()

__all__ = ["Platform", "current_platform"]
