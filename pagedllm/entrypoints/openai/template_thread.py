"""Rendering a request's own chat template (`chat_template`, behind --trust-request-chat-template)
off the event loop, with a time limit.

A template is code: transformers renders it in Jinja's sandbox, which stops attribute tricks but
not work (two nested `range(100000)` loops run for hours). Rendered on the event loop, such a
template would stall every other request, /health included, and the shutdown on SIGTERM. Here
it renders in a daemon thread: the event loop waits at most a time limit (10 s), then answers
400; the thread cannot be stopped from outside and runs on until the template ends, so at most a
few such renders (4) may be alive at once (more: 429), and being a daemon thread it never holds
up the process's exit. The server's own template renders on the event loop as before
(its cost is known).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError

T = TypeVar("T")


class RequestTemplateRenderer:
    """Renders request chat templates in daemon threads (see the module docstring).

    Args:
        time_limit_s: seconds a request waits for its render.
        max_threads: most renders alive at once (a timed-out render stays alive until it ends).
    """

    def __init__(self, time_limit_s: float = 10.0, max_threads: int = 4) -> None:
        self.time_limit_s = time_limit_s
        self.max_threads = max_threads
        self._live = 0
        self._lock = threading.Lock()

    async def render(self, render: Callable[[], T]) -> T:
        """`render()` in a daemon thread, awaited for at most `time_limit_s` seconds.

        Raises:
            OpenAIServingError: 400 naming `chat_template` when the time limit passes, 429
                when `max_threads` renders are still alive; what `render` raises otherwise.
        """
        with self._lock:
            if self._live >= self.max_threads:
                raise OpenAIServingError(
                    f"chat_template: {self.max_threads} request chat templates are still "
                    f"rendering; try again later", 429, param="chat_template")
            self._live += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def deliver(result: object, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def target() -> None:
            result, error = None, None
            try:
                result = render()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                error = e
            finally:
                with self._lock:
                    self._live -= 1
            try:
                loop.call_soon_threadsafe(deliver, result, error)
            except RuntimeError:
                pass        # the event loop is closed: nobody waits any more

        threading.Thread(target=target, name="pagedllm-request-template", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.time_limit_s)
        except asyncio.TimeoutError:
            raise OpenAIServingError(
                f"chat_template: rendering took longer than {self.time_limit_s:g} s", 400,
                param="chat_template") from None
