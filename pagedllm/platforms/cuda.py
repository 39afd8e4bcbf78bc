"""CUDA platform: bf16 by default, memory from the CUDA caching allocator."""

from __future__ import annotations

import importlib.util

import torch

from pagedllm.platforms.interface import Platform


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    worker_multiproc_method = "spawn"
    ray_resource_key = "GPU"

    def preferred_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def init_device(self, local_rank: int = 0, local_world_size: int = 1,
                    threads_bind: str = "auto", reserved_cores: int | None = 0) -> None:
        """Worker `local_rank` uses visible GPU `local_rank` (Ray actors see one GPU each)."""
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch.cuda.reset_peak_memory_stats()

    def kv_cache_budget_bytes(self, memory_utilization: float) -> int:
        """Total memory x utilization, minus what this process's peak (weights + profile run) and
        other processes already use."""
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        return int(total * memory_utilization - used_by_others - torch.cuda.max_memory_allocated())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def peak_memory_bytes(self) -> int:
        return torch.cuda.max_memory_allocated()

    def release_freed_memory(self) -> None:
        torch.cuda.empty_cache()

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def attention_backend_name(self) -> str:
        """The Triton paged kernels when triton is installed (`PAGEDLLM_ATTENTION_BACKEND`
        overrides: triton_paged | torch_sdpa), else torch's SDPA over gathered blocks."""
        name = self.options.attention_backend
        if name:
            return name
        return "triton_paged" if importlib.util.find_spec("triton") is not None else "torch_sdpa"
