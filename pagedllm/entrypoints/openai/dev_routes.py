"""The development-mode routes (vLLM's `VLLM_SERVER_DEV_MODE`; here `PAGEDLLM_SERVER_DEV_MODE=1`):
sleep mode, pause/resume of generation and weight updates for RL trainers driving the server
(docs/sleep_mode.md). They change what the server serves for every client, so they exist only
in dev mode, behind the API key like every other route.

    POST /sleep?level=1|2      GET /is_sleeping       POST /wake_up
    POST /pause?mode=abort|wait|keep                  POST /resume        GET /is_paused
    POST /update_weights  {"model_path": "..."}
    POST /collective_rpc  {"method": "...", "args": [...]}   (a public Worker method by name;
                                                              JSON arguments, JSON results)

Errors: a bad value 400, a call that needs an idle engine while requests run 409, a sleeping
engine 503 (as any generation request gets while it sleeps).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import PAUSE_MODES
from pagedllm.engine.sleep_mode import EngineSleepingError
from pagedllm.entrypoints.openai.protocol import _StrictModel
from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError


# Strict bodies as on the generation routes: a path or method name with a lone surrogate is a
# 400 naming the field, not an error message that cannot be encoded (500).
class UpdateWeightsRequest(_StrictModel):
    model_path: str


class CollectiveRpcRequest(_StrictModel):
    method: str
    args: list[Any] = []


async def _run(call) -> Any:
    """Await an engine call, its errors as HTTP errors (see the module docstring)."""
    try:
        return await call
    except EngineSleepingError as e:
        raise OpenAIServingError(str(e), 503, code="engine_sleeping") from None
    except ValueError as e:
        raise OpenAIServingError(str(e), 400) from None
    except RuntimeError as e:
        raise OpenAIServingError(str(e), 409, code="engine_busy") from None


def add_dev_routes(app: FastAPI, async_llm) -> None:
    """Register the routes of the module docstring over `async_llm` (an `AsyncLLM`)."""

    @app.post("/sleep")
    async def sleep(level: int = Query(1)) -> JSONResponse:
        await _run(async_llm.sleep(level))
        return JSONResponse({"is_sleeping": True, "level": level})

    @app.post("/wake_up")
    async def wake_up() -> JSONResponse:
        await _run(async_llm.wake_up())
        return JSONResponse({"is_sleeping": False})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await async_llm.is_sleeping()})

    @app.post("/pause")
    async def pause(mode: str = Query("abort")) -> JSONResponse:
        if mode not in PAUSE_MODES:
            raise OpenAIServingError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}",
                                     400, param="mode")
        await _run(async_llm.pause_generation(mode))
        return JSONResponse({"is_paused": True})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await _run(async_llm.resume_generation())
        return JSONResponse({"is_paused": False})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": await async_llm.is_paused()})

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> JSONResponse:
        await _run(async_llm.update_weights(body.model_path))
        return JSONResponse({"success": True, "model_path": body.model_path})

    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest) -> JSONResponse:
        results = await _run(async_llm.collective_rpc(body.method, tuple(body.args)))
        try:
            return JSONResponse({"results": results})
        except (TypeError, ValueError):
            raise OpenAIServingError(f"{body.method} returned values that are not JSON "
                                     f"({type(results[0]).__name__})", 400) from None
