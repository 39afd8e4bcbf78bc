"""The server's graceful shutdown (api_server._Server): requests still open when the grace
period is about to end are failed through the engine (their handlers answer with an error
object) instead of being cancelled by uvicorn (a plain-text 500)."""

from __future__ import annotations

import asyncio
import threading

import uvicorn

from pagedllm.entrypoints.openai import api_server


async def _asgi_app(scope, receive, send):   # never called
    raise AssertionError("no request expected")


class _NoLifespan:
    async def shutdown(self) -> None:
        pass


def test_open_requests_end_through_the_engine_before_the_grace_period(monkeypatch):
    monkeypatch.setattr(api_server, "GRACEFUL_SHUTDOWN_S", 1.2)
    stopped = threading.Event()

    async def main() -> asyncio.Task:
        server = api_server._Server(uvicorn.Config(_asgi_app, timeout_graceful_shutdown=1.2),
                                    stopped.set)
        server.servers = []
        server.lifespan = _NoLifespan()

        async def open_request() -> str:   # a handler waiting for its engine request
            while not stopped.is_set():
                await asyncio.sleep(0.01)
            return "503 error object"

        task = asyncio.create_task(open_request())
        server.server_state.tasks.add(task)
        await server.shutdown()
        return task

    task = asyncio.run(main())
    assert stopped.is_set() and not task.cancelled() and task.result() == "503 error object"
