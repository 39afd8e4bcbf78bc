"""LoRA adapters on the server (vLLM's interface): `--lora-modules` at start, a request's
`model` naming an adapter, /v1/models listing adapters with their `parent`, and POST
/v1/load_lora_adapter, /v1/unload_lora_adapter behind `--allow-runtime-lora-updating`.

Each adapter the server loads gets a new `lora_int_id` (never reused), so a name unloaded and
loaded again with another folder can never meet the old adapter's KV blocks or slot. An
adapter with requests in flight is not unloaded: the call is refused (409) and may be retried
once they finish, so no running request ever loses its adapter.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pagedllm.entrypoints.openai.protocol import ModelCard, _StrictModel
from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError
from pagedllm.lora.request import LoRARequest


# Strict bodies (unknown fields, wrong JSON types and lone surrogates are 400s naming the
# field): a name is echoed in answers and listed in /v1/models, which must encode as UTF-8.
class LoadLoRAAdapterRequest(_StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_StrictModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModules:
    """The server's adapters by name, and how many requests use each.

    Args:
        async_llm: the engine (its `check_lora_request` checks an adapter before it is listed).
        served_model_names: every name of the base model (`--served-model-name`; the first is
            the adapters' default `parent`); no adapter may take one, since a request's `model`
            would then select the adapter instead of the base model.
    """

    def __init__(self, async_llm, served_model_names: Sequence[str]) -> None:
        self.async_llm = async_llm
        self.base_model_name = served_model_names[0]
        self.served_model_names = frozenset(served_model_names)
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self.in_use: Counter[str] = Counter()
        self._ids = itertools.count(1)

    def load(self, name: str, path: str, parent: str | None = None) -> LoRARequest:
        """Check and list an adapter under `name`.

        Raises:
            OpenAIServingError: 400 naming `lora_name` (empty, already in use, or a name of the
                base model) or `lora_path` (empty, or the engine refused the adapter: its
                reason).
        """
        if name in self.served_model_names:
            raise OpenAIServingError(f"The LoRA adapter name '{name}' is a served name of the "
                                     f"base model; choose another.", 400, param="lora_name")
        if name in self.adapters:
            raise OpenAIServingError(f"The LoRA adapter '{name}' has already been loaded.",
                                     400, param="lora_name")
        try:
            lora = LoRARequest(name, next(self._ids), path)
        except ValueError as e:  # an empty name or path: the request's fault, not a 500
            field = "lora_name" if str(e).startswith("lora_name") else "lora_path"
            raise OpenAIServingError(str(e), 400, param=field) from None
        try:
            self.async_llm.check_lora_request(lora)
        except ValueError as e:
            raise OpenAIServingError(str(e).removeprefix("lora_request: "), 400,
                                     param="lora_path") from None
        self.adapters[name] = lora
        self.parents[name] = parent or self.base_model_name
        return lora

    def unload(self, name: str) -> None:
        """Remove an adapter no request uses.

        Raises:
            OpenAIServingError: 404 for an unknown name, 409 while requests use it.
        """
        lora = self.adapters.get(name)
        if lora is None:
            raise OpenAIServingError(f"The LoRA adapter '{name}' cannot be found.", 404,
                                     param="lora_name", code="model_not_found")
        if self.in_use[name]:
            raise OpenAIServingError(
                f"The LoRA adapter '{name}' is in use by {self.in_use[name]} requests; unload "
                f"it once they finish.", 409, param="lora_name")
        del self.adapters[name], self.parents[name]
        self.async_llm.forget_lora(lora.lora_int_id)

    def acquire(self, name: str | None) -> LoRARequest | None:
        """The adapter `name` selects (None: not an adapter), counted in use until `release`."""
        lora = self.adapters.get(name) if name is not None else None
        if lora is not None:
            self.in_use[name] += 1
        return lora

    def release(self, name: str) -> None:
        self.in_use[name] -= 1

    def cards(self, max_model_len: int) -> list[ModelCard]:
        """/v1/models entries of the adapters: `root` their folder, `parent` their base."""
        return [ModelCard(id=name, root=lora.lora_path, parent=self.parents[name],
                          max_model_len=max_model_len) for name, lora in self.adapters.items()]


def add_lora_routes(app: FastAPI, modules: LoRAModules) -> None:
    """Register POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's paths)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        modules.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        modules.unload(body.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
