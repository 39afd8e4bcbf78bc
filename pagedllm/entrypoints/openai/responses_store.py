"""The in-memory store of responses created with `store: true` (`previous_response_id`, GET).

One entry per stored response: the Response object as answered and the conversation it closes
(the input items of every turn, without instructions, followed by its output items), which a
request naming it as `previous_response_id` continues. Bounded three ways, oldest evicted first:
a count, an age (an entry older than `max_age_s` is gone) and the total size of the entries'
JSON. Kept in this process only: a restart forgets everything, and nothing is written to disk.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Defaults of the store's caps (docs/openai_api.md states them).
MAX_STORED_RESPONSES = 1000
MAX_STORED_AGE_S = 3600.0
MAX_STORED_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its JSON-ready Response object and its whole conversation (input
    items of every turn, then this turn's output items, as JSON-ready dicts)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int           # bytes of both as JSON
    stored_at: float    # time.monotonic() seconds


class ResponseStore:
    """An LRU map from response id to `StoredResponse` with caps on count, age and bytes.

    Args:
        max_entries: most responses kept.
        max_age_s: seconds an entry is kept after it was stored.
        max_bytes: most bytes of JSON kept in all (an entry alone larger is not kept).

    Raises:
        ValueError: a cap below 1 (or a non-positive age).
    """

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES,
                 max_age_s: float = MAX_STORED_AGE_S, max_bytes: int = MAX_STORED_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1 or not max_age_s > 0:
            raise ValueError(f"response store caps must be positive, got max_entries="
                             f"{max_entries}, max_age_s={max_age_s}, max_bytes={max_bytes}")
        self.max_entries, self.max_age_s, self.max_bytes = max_entries, max_age_s, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store `response` (keyed by its "id") with its conversation; returns False when the
        entry alone is over `max_bytes` (then nothing is stored)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return False
        self._drop(response["id"])
        self._entries[response["id"]] = StoredResponse(response, conversation, size,
                                                       time.monotonic())
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None if it was never stored, was evicted or has expired. A hit makes it
        the most recently used."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def _expire(self) -> None:
        deadline = time.monotonic() - self.max_age_s
        expired = [key for key, entry in self._entries.items() if entry.stored_at < deadline]
        for key in expired:
            self._drop(key)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
