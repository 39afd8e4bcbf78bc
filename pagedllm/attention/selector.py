"""Choose the attention backend from the platform (the only place that decides)."""

from __future__ import annotations

from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.backends.triton_paged import TritonPagedBackend
from pagedllm.platforms import current_platform

_BACKENDS = {b.name: b for b in (TorchSDPABackend, CpuPagedBackend, TritonPagedBackend)}


def get_attention_backend():
    """The backend class for `current_platform`.

    Raises:
        ValueError: for an unknown name, or a backend that cannot run here (`cpu_paged` without
            its compiled kernel, `triton_paged` without triton).
    """
    name = current_platform.attention_backend_name()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    backend = _BACKENDS[name]
    if not getattr(backend, "is_available", lambda: True)():
        reason = getattr(backend, "unavailable_reason",
                         lambda: "its native kernel did not build; see the log")()
        raise ValueError(f"attention backend {name!r} is not available here ({reason}); use "
                         f"torch_sdpa")
    return backend
