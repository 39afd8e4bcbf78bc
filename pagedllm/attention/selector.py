"""Choose the attention backend from the platform (the only place that decides)."""

from __future__ import annotations

from pagedllm.attention.backends.cpu_paged import CpuPagedBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.platforms import current_platform

_BACKENDS = {b.name: b for b in (TorchSDPABackend, CpuPagedBackend)}


def get_attention_backend():
    """The backend class for `current_platform`.

    Raises:
        ValueError: for an unknown name, or a backend that cannot run here (`cpu_paged` without
            its compiled kernel).
    """
    name = current_platform.attention_backend_name()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    backend = _BACKENDS[name]
    if not getattr(backend, "is_available", lambda: True)():
        raise ValueError(f"attention backend {name!r} is not available here (its native kernel "
                         f"did not build; see the log); use torch_sdpa")
    return backend
