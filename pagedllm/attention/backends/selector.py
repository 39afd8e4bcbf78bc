"""Choose the attention backend from the platform (the only place that decides)."""

from __future__ import annotations

from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.attention.backends.dsa_cpu import DSACpuBackend
from pagedllm.attention.backends.dsa_torch import DSATorchBackend
from pagedllm.attention.backends.mla_cpu import MLACpuBackend
from pagedllm.attention.backends.mla_torch import MLATorchBackend
from pagedllm.attention.backends.mla_triton import MLATritonBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.backends.triton_paged import TritonPagedBackend
from pagedllm.platforms import current_platform

_BACKENDS = {b.name: b for b in (TorchSDPABackend, CpuPagedBackend, TritonPagedBackend)}


def get_attention_backend():
    """The backend class for `current_platform`: its `attention_backend_name()` looked up among
    the built-in backends plus the one the platform brings (`get_attention_backend_cls()`, used
    by plugin platforms).

    Raises:
        ValueError: for an unknown name, a platform backend class without a string `name`, or a
            backend that cannot run here (`cpu_paged` without its compiled kernel,
            `triton_paged` without triton).
    """
    backends = dict(_BACKENDS)
    platform_backend = current_platform.get_attention_backend_cls()
    if platform_backend is not None:
        if not isinstance(getattr(platform_backend, "name", None), str):
            raise ValueError(f"attention backend {platform_backend!r} of platform "
                             f"{current_platform.device_type!r} has no string `name`")
        backends[platform_backend.name] = platform_backend
    name = current_platform.attention_backend_name()
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(backends)}")
    backend = backends[name]
    if not getattr(backend, "is_available", lambda: True)():
        reason = getattr(backend, "unavailable_reason",
                         lambda: "its native kernel did not build; see the log")()
        raise ValueError(f"attention backend {name!r} is not available here ({reason}); use "
                         f"torch_sdpa")
    return backend


def get_mla_attention_backend():
    """The backend of MLA layers (layers/mla_attention.py), following the platform's attention
    backend: `mla_cpu_paged` (the native kernel for absorbed decode and short prefill chunks)
    for `cpu_paged`, `mla_triton` (Triton kernels for absorbed decode and prefill; CUDA's
    default) for `triton_paged`,
    else the torch reference `mla_torch` (any device; `PAGEDLLM_ATTENTION_BACKEND=torch_sdpa`
    picks it)."""
    name = current_platform.attention_backend_name()
    if name == "cpu_paged" and MLACpuBackend.is_available():
        return MLACpuBackend
    if name == "triton_paged" and MLATritonBackend.is_available():
        return MLATritonBackend
    return MLATorchBackend


def get_dsa_attention_backend():
    """The backend of DSA layers (layers/sparse_mla_attention.py), following the platform's
    attention backend: `dsa_cpu_paged` (the native kernels for decode rows) for `cpu_paged`,
    else the torch reference `dsa_torch` (any device; CUDA has no DSA kernel yet)."""
    if current_platform.attention_backend_name() == "cpu_paged" and DSACpuBackend.is_available():
        return DSACpuBackend
    return DSATorchBackend
