"""The one forward context: per-step attention metadata, set for the duration of one forward.

Only the runners set it (with `set_forward_context`); `layers/attention.py` reads it, and so
does the native decoder stack (`native/attach.py`), which runs the attention layers' work in one
native call. Models never read it. It is frozen and has fixed fields; nothing else may be stored here. It is per thread: engine replicas
that run their steps on different threads of one process (data-parallel serving) each see their
own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_local = threading.local()


@dataclass(frozen=True)
class ForwardContext:
    """attn_metadata: the backend's metadata for this step (one object shared by all layers).
    kv_hooks: the KV connector's per-layer seams of this step (worker/kv_connector/base.py,
    `KVLayerHooks`: `wait_for_layer_load(layer_name)` before a layer reads its KV cache,
    `save_kv_layer(layer_name, kv_cache)` after it wrote it), or None (no connector)."""

    attn_metadata: Any
    kv_hooks: Any = None


@contextmanager
def set_forward_context(attn_metadata: Any, kv_hooks: Any = None) -> Iterator[None]:
    prev = getattr(_local, "context", None)
    _local.context = ForwardContext(attn_metadata, kv_hooks)
    try:
        yield
    finally:
        _local.context = prev


def get_forward_context() -> ForwardContext:
    """The context of the forward running on this thread.

    Raises:
        RuntimeError: when called outside `set_forward_context`.
    """
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return context
