"""Platform plugins: choose the `Platform` class, built in or registered by another package.

An installed package adds a device platform through the entry-point group
`pagedllm.platform_plugins` (the design of vLLM's `vllm.platform_plugins`), e.g. in its
pyproject.toml:

    [project.entry-points."pagedllm.platform_plugins"]
    my_npu = "my_npu_pkg:platform_plugin"

Each entry point is a zero-argument function that returns the dotted path of a `Platform`
subclass ("my_npu_pkg.platform.NpuPlatform") when its device is usable here, else None. The
function should be cheap and must not import the engine: it runs on every platform resolution.

Resolution order (`resolve_platform`):
    1. `PAGEDLLM_PLATFORM` names a plugin, "cpu" or "cuda": that one, or an error saying why not
       (`PAGEDLLM_DEVICE=cpu|cuda`, the older switch, counts as `PAGEDLLM_PLATFORM` when that is
       unset).
    2. the first plugin (by entry-point name) whose function returns a path.
    3. CUDA when torch sees a GPU.
    4. the CPU.
A plugin that raises, or returns something that is not the path of a `Platform` subclass, fails
resolution with an error naming the plugin; it is never skipped silently.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points

from pagedllm import envs
from pagedllm.platforms.interface import Platform

logger = logging.getLogger(__name__)

PLATFORM_PLUGINS_GROUP = "pagedllm.platform_plugins"
PLATFORM_ENV = "PAGEDLLM_PLATFORM"
_BUILTIN = {"cpu": "pagedllm.platforms.cpu.CpuPlatform",
            "cuda": "pagedllm.platforms.cuda.CudaPlatform"}


class PlatformPluginError(RuntimeError):
    """A platform plugin failed, or `PAGEDLLM_PLATFORM` names a platform that cannot be used."""


def load_platform_plugins() -> dict[str, Callable[[], str | None]]:
    """The functions registered under `pagedllm.platform_plugins`, by entry-point name (sorted).

    Raises:
        PlatformPluginError: if an entry point cannot be loaded (its module fails to import),
            naming the plugin; or if a plugin uses a built-in name ("cpu", "cuda").
    """
    plugins: dict[str, Callable[[], str | None]] = {}
    for ep in sorted(entry_points(group=PLATFORM_PLUGINS_GROUP), key=lambda e: e.name):
        if ep.name in _BUILTIN:
            raise PlatformPluginError(f"platform plugin {ep.name!r} ({ep.value}) uses the name of "
                                      f"a built-in platform; rename its entry point")
        if ep.name in plugins:
            logger.warning("platform plugin %r is registered twice; using the first", ep.name)
            continue
        try:
            plugins[ep.name] = ep.load()
        except Exception as e:
            raise PlatformPluginError(f"platform plugin {ep.name!r} ({ep.value}) failed to load: "
                                      f"{type(e).__name__}: {e}") from e
    return plugins


def _call_plugin(name: str, fn: Callable[[], str | None]) -> str | None:
    """What plugin `name` reports: a dotted class path, or None (device not available)."""
    try:
        path = fn()
    except Exception as e:
        raise PlatformPluginError(f"platform plugin {name!r} raised {type(e).__name__}: {e}") from e
    if path is not None and (not isinstance(path, str) or "." not in path):
        raise PlatformPluginError(f"platform plugin {name!r} must return the dotted path of a "
                                  f"Platform subclass or None, got {path!r}")
    return path


def import_platform_cls(path: str, source: str) -> type[Platform]:
    """The class at dotted `path` ("pkg.module.Class"), checked to subclass `Platform`.

    `source` names where the path came from (a plugin) for the error message.

    Raises:
        PlatformPluginError: if the module does not import, has no such attribute, or the
            attribute is not a concrete `Platform` subclass.
    """
    module_name, _, cls_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise PlatformPluginError(f"{source} returned {path!r}, which cannot be imported: "
                                  f"{type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise PlatformPluginError(f"{source} returned {path!r}, which is not a subclass of "
                                  f"pagedllm.platforms.interface.Platform")
    if getattr(cls, "__abstractmethods__", None):
        raise PlatformPluginError(f"{source} returned {path!r}, which leaves abstract methods "
                                  f"unimplemented: {sorted(cls.__abstractmethods__)}")
    return cls


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _builtin_platform(name: str) -> Platform:
    """"cpu" or "cuda", asked for by name.

    Raises:
        PlatformPluginError: for "cuda" when torch sees no CUDA device.
    """
    if name == "cuda" and not _cuda_available():
        raise PlatformPluginError(f"{PLATFORM_ENV} (or PAGEDLLM_DEVICE) is 'cuda' but torch sees "
                                  f"no CUDA device")
    return import_platform_cls(_BUILTIN[name], f"built-in platform {name!r}")()


def resolve_platform() -> Platform:
    """Build the platform the engine runs on, in the order of the module docstring.

    Raises:
        PlatformPluginError: if `PAGEDLLM_PLATFORM` names an unknown platform or a plugin whose
            device is not available, or a plugin consulted raises or returns a bad path.
        ValueError: if `PAGEDLLM_DEVICE` is set to something other than "cpu" or "cuda".
    """
    plugins = load_platform_plugins()
    wanted = envs.get(PLATFORM_ENV) or envs.get("PAGEDLLM_DEVICE") or ""
    if wanted:
        if wanted.lower() in _BUILTIN:
            return _builtin_platform(wanted.lower())
        if wanted not in plugins:
            raise PlatformPluginError(f"{PLATFORM_ENV}={wanted!r} names no platform; known: "
                                      f"{sorted(_BUILTIN) + sorted(plugins)}")
        path = _call_plugin(wanted, plugins[wanted])
        if path is None:
            raise PlatformPluginError(f"{PLATFORM_ENV}={wanted!r}, but that plugin reports its "
                                      f"device is not available here")
        return import_platform_cls(path, f"platform plugin {wanted!r}")()
    for name, fn in plugins.items():
        path = _call_plugin(name, fn)
        if path is not None:
            logger.info("platform plugin %r selected (%s)", name, path)
            return import_platform_cls(path, f"platform plugin {name!r}")()
    return _builtin_platform("cuda" if _cuda_available() else "cpu")
