"""The one forward context: per-step attention metadata, set for the duration of one forward.

Only `worker/model_runner.py` sets it (with `set_forward_context`), only `layers/attention.py` reads
it. It is frozen and has fixed fields; nothing else may be stored here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_forward_context: ForwardContext | None = None


@dataclass(frozen=True)
class ForwardContext:
    """attn_metadata: the backend's metadata for this step (one object shared by all layers)."""

    attn_metadata: Any


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("attention called outside set_forward_context()")
    return _forward_context
