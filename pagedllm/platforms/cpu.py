"""CPU platform: bf16 where the CPU has native bf16 math (AVX512-BF16 or AMX), fp32 otherwise."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.kernels import ops
from pagedllm.native.kernels.ops import cpu_linear, cpu_linear_supported
from pagedllm.omp_wait import wait_policy_description
from pagedllm.platforms.cpu_contention import ThreadGovernor
from pagedllm.platforms.cpu_topology import (allowed_cpus, bind_process, format_cpu_list,
                                             plan_threads, read_cpu_quota, read_topology,
                                             reserved_cpus, resolve_reserved_cores)
from pagedllm.platforms.interface import Platform

logger = logging.getLogger(__name__)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


class CpuPlatform(Platform):
    device_type = "cpu"
    cap_kv_cache_at_need = True
    profile_run_at_max_batch = False

    def __init__(self) -> None:
        flags = _cpu_flags()
        self.has_native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
        self.has_avx512 = "avx512f" in flags
        self.thread_governor: ThreadGovernor | None = None     # set by init_device

    def preferred_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.has_native_bf16 else torch.float32

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def mem_get_info(self) -> tuple[int, int]:
        return _available_memory_bytes(), _total_memory_bytes()

    def init_device(self, local_rank: int = 0, local_world_size: int = 1,
                    threads_bind: str = "auto", reserved_cores: int | None = 0) -> None:
        """The intra-op threads and the cores of process `local_rank` of `local_world_size` on
        this machine (`cpu_topology.plan_threads`: one thread per physical core this process may
        use, within its cgroup CPU quota; processes of one machine on disjoint cores, a NUMA
        node each where there are enough; `threads_bind` "auto", "nobind" or vLLM-style CPU
        lists; `reserved_cores` physical cores left to the front end, None: one where there
        are at least 8). Logs what was chosen and why. `PAGEDLLM_CPU_THREADS` overrides the
        count and leaves the affinity alone; `PAGEDLLM_CPU_NUMA_BIND=0` keeps the process off
        whole-node binding (both from `options`).

        Raises:
            ValueError: a `threads_bind` that does not parse, does not give one CPU list per
                process or names CPUs this process may not use; `reserved_cores` leaving no
                core; where `options` are first read here, if PAGEDLLM_CPU_THREADS is not an
                integer in [1, 1024] or PAGEDLLM_CPU_NUMA_BIND is not an on/off value.
        """
        options = self.options
        self.thread_governor = None
        if options.cpu_threads is not None:
            torch.set_num_threads(options.cpu_threads)
            logger.info("CPU: %d threads (PAGEDLLM_CPU_THREADS), unbound; OpenMP waits: %s",
                        options.cpu_threads, wait_policy_description())
            self.placement = f"{options.cpu_threads} CPU thread(s) (PAGEDLLM_CPU_THREADS)"
            return
        allowed, topology = allowed_cpus(), read_topology()
        quota = read_cpu_quota()
        plan = plan_threads(allowed, topology, local_rank, local_world_size,
                            bind=options.cpu_numa_bind, threads_bind=threads_bind,
                            cpu_quota=quota[0] if quota else None,
                            reserved_cores=resolve_reserved_cores(reserved_cores, allowed,
                                                                  topology))
        if plan.bind is not None and plan.bind != allowed:
            bind_process(plan.bind)
        where = (f"bound to CPUs {format_cpu_list(plan.bind)}" if plan.bind is not None
                 else "unbound")
        quota_note = f" (the quota read from {quota[1]})" if quota else ""
        adaptive = options.cpu_adaptive_threads and plan.num_threads > 1
        logger.info("CPU: %d thread%s, %s: %s%s; OpenMP waits: %s; %s", plan.num_threads,
                    "" if plan.num_threads == 1 else "s", where, plan.reason, quota_note,
                    wait_policy_description(),
                    "fewer while other processes need these cores" if adaptive
                    else "a fixed count")
        torch.set_num_threads(plan.num_threads)
        self.placement = f"{plan.num_threads} CPU thread(s), {where} ({plan.reason})"
        self.thread_governor = (ThreadGovernor(plan.num_threads, plan.bind or allowed,
                                               torch.set_num_threads) if adaptive else None)

    def before_step(self) -> None:
        if self.thread_governor is not None:
            self.thread_governor.step_started()

    def after_step(self) -> None:
        """Let the thread governor (if any) fit the thread count to the cores this process
        gets (cpu_contention.ThreadGovernor; at most once an interval)."""
        if self.thread_governor is not None:
            self.thread_governor.observe()

    def bind_front_end(self, reserved_cores: int | None) -> None:
        """Move the calling thread (the API server's event loop; threads it starts later
        inherit it) to the cores `init_device` left to the front end, if any."""
        allowed, topology = allowed_cpus(), read_topology()
        cpus = reserved_cpus(allowed, topology,
                             resolve_reserved_cores(reserved_cores, allowed, topology))
        if cpus:
            os.sched_setaffinity(0, cpus)
            logger.info("CPU: the front end on CPUs %s (reserved from the kernels)",
                        format_cpu_list(cpus))

    def release_freed_memory(self) -> None:
        """glibc's `malloc_trim(0)`: the heap's free pages go back to the system (tensors below
        the mmap threshold live there, and a freed one's pages otherwise stay resident)."""
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.malloc_trim(0)
        except (OSError, AttributeError):   # not glibc: nothing to trim
            pass

    def kv_cache_budget_bytes(self, memory_utilization: float) -> int:
        """`memory_utilization` of the memory available now, capped at PAGEDLLM_CPU_KVCACHE_SPACE
        GiB (default 4, like vLLM's VLLM_CPU_KVCACHE_SPACE): on a CPU the KV cache shares RAM
        with everything else on the machine.

        Raises:
            ValueError: where `options` are first read here, if PAGEDLLM_CPU_KVCACHE_SPACE is
                not a positive number.
        """
        cap_gib = self.options.cpu_kvcache_space
        free, _ = self.mem_get_info()
        return int(min(free * memory_utilization, cap_gib * 2**30))

    # Where the native kernel beats torch (measured on an AVX2 EPYC, llama-134m shapes): MKL's
    # fp32 GEMM wins from about 128 rows; torch's bf16 GEMM without native bf16 math loses at
    # every size, but from ~512 rows widening the weight to fp32 and calling MKL wins (by how
    # much: docs/benchmarks.md, "Measurements behind choices in the code"); with native bf16
    # (AVX512-BF16/AMX through oneDNN) torch wins beyond GEMV sizes.
    _KERNEL_MAX_ROWS_F32 = 64
    _KERNEL_MAX_ROWS_BF16_NATIVE = 16
    _WIDEN_MIN_ROWS_BF16 = 512

    def _native_linear_max_rows(self, dtype: torch.dtype) -> int:
        if dtype == torch.bfloat16:
            return (self._KERNEL_MAX_ROWS_BF16_NATIVE if self.has_native_bf16
                    else self._WIDEN_MIN_ROWS_BF16 - 1)
        return self._KERNEL_MAX_ROWS_F32 if dtype == torch.float32 else 0

    def fused_decoder_max_tokens(self, dtype: torch.dtype, packed_weights: bool = False) -> int:
        """Every step size on AVX2-class CPUs, where the native kernels beat torch's GEMMs at
        all sizes measured (llama-134m, 1-2048 tokens), and wherever the linear weights are
        packed (`pack_linear_weight`: the packed GEMM matches or beats MKL/oneDNN at every size
        measured, docs/benchmarks.md "Packed GEMM"); with AVX-512 and unpacked weights,
        MKL/oneDNN GEMMs outrun the dot-product kernels on large steps, so the fused path keeps
        to the GEMV sizes where that kernel is used anyway."""
        if cpu_kernels() is None or dtype not in (torch.float32, torch.bfloat16):
            return 0
        if self.has_avx512 and not packed_weights:
            return self._native_linear_max_rows(dtype)
        return 1 << 30

    def pack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight in the packed GEMM's panels (`ops.pack_linear_weight`) when the kernels
        built, the weight fits (`ops.packed_gemm_supported`) and `PAGEDLLM_CPU_PACKED_GEMM` is
        not 0/false/off/no; else None. Packing pays at every row count measured (1-512 rows,
        fp32 and bf16, AVX2 and AVX-512: docs/benchmarks.md "Packed GEMM"), so it is not
        limited to some sizes."""
        if (not self.options.cpu_packed_gemm or cpu_kernels() is None
                or not ops.packed_gemm_supported(weight)):
            return None
        return ops.pack_linear_weight(weight)

    def packed_linear(self, x: torch.Tensor, packed_weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """The packed GEMM (`csrc/packed_gemm.h`) at every row count; [..., N] in x's dtype."""
        return ops.packed_linear(x, packed_weight, bias)

    def unpack_linear_weight(self, packed_weight: torch.Tensor) -> torch.Tensor:
        return ops.unpack_linear_weight(packed_weight)

    def packed_embedding(self, packed_weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ops.packed_weight_rows(packed_weight, ids)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The native kernel (`pagedllm/native/kernels/csrc/cpu_linear.cpp`) where it is faster (see
        the thresholds above), torch's GEMM otherwise. float32 output from bfloat16 operands
        (the LM head's logits) comes straight from the kernel's float32 accumulators, at every
        row count (torch's native-bf16 GEMM would round the result to bf16 first)."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        float32_from_bf16 = weight.dtype == torch.bfloat16 and out_dtype == torch.float32
        if (weight.dtype == torch.bfloat16 and not self.has_native_bf16
                and rows >= self._WIDEN_MIN_ROWS_BF16):
            y = torch.nn.functional.linear(x.float(), weight.float(),
                                           None if bias is None else bias.float())
            return y.to(out_dtype or x.dtype)
        if (rows <= self._native_linear_max_rows(weight.dtype) or float32_from_bf16) \
                and cpu_linear_supported(x, weight):
            if out_dtype == torch.float32:
                return cpu_linear(x.float(), weight, bias, checked=True)
            y = cpu_linear(x, weight, bias, checked=True)
        else:
            y = torch.nn.functional.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)

    def attention_backend_name(self) -> str:
        """The native paged kernel when it builds here (`PAGEDLLM_ATTENTION_BACKEND` overrides),
        else torch's SDPA over gathered blocks."""
        name = self.options.attention_backend
        if name:
            return name
        return "cpu_paged" if cpu_kernels() is not None else "torch_sdpa"
