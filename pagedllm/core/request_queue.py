"""The scheduler's waiting queues: first come first served, or by priority (vLLM's
`--scheduling-policy fcfs|priority`).

Both answer the same calls, so the scheduler never branches on the policy to queue a request:
`add` (a new request, or a preempted one going back), `peek`/`pop` (the next one to admit),
`push_front` (requests put back unadmitted this step), `remove`, `len`, iteration.

- FCFS: arrival order; a preempted request goes back to the front (it was admitted before every
  request still waiting).
- Priority: lower `priority` first, ties by `arrival_time` (then by id, so the order is total),
  wherever a request comes from; a binary heap.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from pagedllm.config import SCHEDULING_POLICIES
from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import INT64_MIN, check_int



class RequestQueue(Protocol):
    """What the scheduler asks of its waiting queue."""

    def add(self, request: Request) -> None: ...

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def push_front(self, requests: Iterable[Request]) -> None: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """Arrival order; a preempted request returns to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        if request.status == RequestStatus.PREEMPTED:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def push_front(self, requests: Iterable[Request]) -> None:
        self._queue.extendleft(reversed(list(requests)))

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def priority_key(request: Request) -> tuple[int, float, str]:
    """The order of the priority policy: lower priority value first, then earlier arrival."""
    return request.priority, request.arrival_time, request.request_id


class PriorityRequestQueue:
    """Lower `priority` first, ties by arrival; a min-heap of (key, request)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def push_front(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))


def check_priority(priority: int, policy: str) -> None:
    """Raises ValueError (naming `priority`) for a value that is not an int64, or that is
    non-zero under the fcfs policy (vLLM's rule: a priority there would be silently ignored)."""
    check_int("priority", priority, INT64_MIN)
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority {priority} needs the priority scheduling policy (start the "
                         f"engine with scheduling_policy='priority', --scheduling-policy "
                         f"priority); under {policy!r} every request has priority 0")


def make_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of `policy` ("fcfs" or "priority").

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got "
                     f"{policy!r}")
