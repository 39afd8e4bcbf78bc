"""`current_platform`: the one place that decides which device the engine runs on.

The platform is resolved on first use (`plugins.resolve_platform`: `PAGEDLLM_PLATFORM`, then
installed `pagedllm.platform_plugins`, then CUDA when torch sees a GPU, then the CPU) and kept
for the life of the process. `current_platform` forwards every attribute to that object, so
modules may bind it at import time (`from pagedllm.platforms import current_platform`) and still
see the platform chosen later; `reset_current_platform()` drops the cached choice (tests that
change the environment or the installed plugins).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.platforms.interface import Platform

_resolved: Platform | None = None


def get_current_platform() -> Platform:
    """The resolved `Platform` object (resolving it on the first call).

    Raises:
        PlatformPluginError: if a platform plugin fails or `PAGEDLLM_PLATFORM` names an unusable
            platform (see `pagedllm.platforms.plugins`).
    """
    global _resolved
    if _resolved is None:
        from pagedllm.platforms.plugins import resolve_platform
        _resolved = resolve_platform()
    return _resolved


def reset_current_platform() -> None:
    """Forget the resolved platform; the next use of `current_platform` resolves it again."""
    global _resolved
    _resolved = None


class _CurrentPlatform:
    """Forwards attribute reads to `get_current_platform()` (vLLM resolves its
    `current_platform` lazily too, through a module `__getattr__`)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(_resolved if _resolved is not None else get_current_platform(), name)

    def __repr__(self) -> str:
        return f"current_platform -> {get_current_platform()!r}"


if TYPE_CHECKING:
    current_platform: Platform
else:
    current_platform = _CurrentPlatform()

__all__ = ["Platform", "current_platform", "get_current_platform", "reset_current_platform"]
