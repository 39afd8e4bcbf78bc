"""RequestTemplateRenderer: a request's chat template renders off the event loop, bounded in
time and in the number of renders alive."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError
from pagedllm.entrypoints.openai.template_thread import RequestTemplateRenderer


def test_results_errors_time_limit_and_thread_cap() -> None:
    renderer = RequestTemplateRenderer(time_limit_s=0.2, max_threads=2)
    release = threading.Event()

    def stuck() -> str:          # a template that runs until the test lets it go
        release.wait(30)
        return "late"

    def broken() -> str:
        raise ValueError("bad template")

    async def run() -> None:
        assert await renderer.render(lambda: "text") == "text"
        with pytest.raises(ValueError, match="bad template"):
            await renderer.render(broken)
        ticks = 0

        async def tick() -> None:            # the event loop keeps running meanwhile
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        for _ in range(2):
            with pytest.raises(OpenAIServingError) as timed_out:
                await renderer.render(stuck)
            assert timed_out.value.status_code == 400
            assert timed_out.value.param == "chat_template"
        assert time.monotonic() - started < 2 and ticks >= 10
        with pytest.raises(OpenAIServingError) as busy:        # two renders still alive
            await renderer.render(lambda: "text")
        assert busy.value.status_code == 429
        ticker.cancel()
        release.set()
        for _ in range(100):                 # the stuck renders end; the cap frees again
            await asyncio.sleep(0.02)
            try:
                assert await renderer.render(lambda: "again") == "again"
                return
            except OpenAIServingError:
                continue
        raise AssertionError("the thread cap never freed")

    asyncio.run(run())
