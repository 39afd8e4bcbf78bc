"""LoRA through the `openai` client against `pagedllm serve --enable-lora`: `--lora-modules`
adapters (both flag forms) selected by `model` give the tokens `LLM.generate` gives under the same
adapter, /v1/models lists them with their parent, a runtime load and unload, and bad adapters
refused with 400 naming the field; the server's adapter table refuses to unload an adapter while
requests use it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError
from pagedllm.entrypoints.openai.serving_lora import LoRAModules
from tests.entrypoints.openai.server_process import running_server
from tests.lora.adapters import ALL_LINEAR, ATTENTION, make_peft_adapter

PROMPT = "To be or not"


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_loras")
    return {"alpha": make_peft_adapter(tiny_llama, folder / "alpha", 4, ALL_LINEAR, 8, False, 0),
            "beta": make_peft_adapter(tiny_llama, folder / "beta", 8, ATTENTION, 16, False, 1),
            "gamma": make_peft_adapter(tiny_llama, folder / "gamma", 8, ALL_LINEAR, 8, True, 2)}


def _offline_texts(model, adapters) -> dict[str | None, str]:
    llm = LLM(str(model), dtype="float32", kv_cache_memory_bytes=4 << 20, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    names = [None, *adapters]
    loras = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    outs = llm.generate([PROMPT] * len(names), params, use_tqdm=False, lora_request=loras)
    return {n: o.outputs[0].text for n, o in zip(names, outs)}


def test_lora_modules_runtime_load_unload(tiny_llama, adapters):
    want = _offline_texts(tiny_llama, adapters)
    assert len(set(want.values())) == 4, "the adapters must change the text"
    beta = json.dumps({"name": "beta", "path": str(adapters["beta"]),
                       "base_model_name": "base"})
    args = ["--model", str(tiny_llama), "--served-model-name", "base", "--dtype", "float32",
            "--kv-cache-memory-bytes", "4000000", "--uvicorn-log-level", "warning",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"alpha={adapters['alpha']}", beta,
            "--allow-runtime-lora-updating"]
    with running_server(args) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")

        def complete(model: str) -> str:
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                              temperature=0.0,
                                              extra_body={"ignore_eos": True}).choices[0].text

        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "alpha", "beta"}
        assert cards["alpha"].parent == "base" and cards["alpha"].root == str(adapters["alpha"])
        assert cards["base"].parent is None
        assert complete("base") == want[None]
        assert complete("alpha") == want["alpha"]
        assert complete("beta") == want["beta"]
        chat = client.chat.completions.create(model="beta", max_tokens=4, temperature=0.0,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.model == "beta"

        with pytest.raises(openai.NotFoundError):
            complete("gamma")
        r = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])})
        assert r.status_code == 200, r.text
        assert complete("gamma") == want["gamma"]
        assert "gamma" in {m.id for m in client.models.list().data}

        r = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "gamma", "lora_path": str(adapters["alpha"])})
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "bad", "lora_path": str(adapters["alpha"]) + "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"

        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            complete("gamma")
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert r.status_code == 404
        assert complete("alpha") == want["alpha"]


def test_unload_refused_while_in_use(tiny_llama, adapters):
    engine = AsyncLLM.from_engine_args(str(tiny_llama), dtype="float32",
                                       kv_cache_memory_bytes=2 << 20, enable_lora=True,
                                       max_lora_rank=8)
    try:
        modules = LoRAModules(engine, ["base"])
        first = modules.load("alpha", str(adapters["alpha"]))
        assert modules.acquire("alpha") == first and modules.acquire("base") is None
        with pytest.raises(OpenAIServingError, match="in use by 1 requests") as info:
            modules.unload("alpha")
        assert info.value.status_code == 409
        modules.release("alpha")
        modules.unload("alpha")
        # Loaded again from another folder: a new id, so no old KV block or slot is reused.
        second = modules.load("alpha", str(adapters["gamma"]))
        assert second.lora_int_id != first.lora_int_id
    finally:
        engine.shutdown()


def test_adapter_may_not_take_a_served_model_name(adapters):
    # Listed under the base model's name, an adapter would take the base model's requests
    # (`model` selects adapters first): refused before the engine is asked about the adapter.
    modules = LoRAModules(None, ["base", "alias"])
    for name in ("base", "alias"):
        with pytest.raises(OpenAIServingError, match=f"'{name}' is a served name") as info:
            modules.load(name, str(adapters["alpha"]))
        assert info.value.status_code == 400 and info.value.param == "lora_name"
    assert modules.adapters == {}


def test_empty_adapter_name_or_path_is_a_400_naming_the_field():
    # The load route took {"lora_name": ""} to LoRARequest's own check, a ValueError that
    # left the route as a 500 "internal error": refused as a bad request instead.
    modules = LoRAModules(None, ["base"])
    for name, path, field in (("", "/p", "lora_name"), ("  ", "/p", "lora_name"),
                              ("x", "", "lora_path")):
        with pytest.raises(OpenAIServingError, match=f"{field} must be a non-empty") as info:
            modules.load(name, path)
        assert info.value.status_code == 400 and info.value.param == field
    assert modules.adapters == {}


def test_lone_surrogate_in_lora_routes_is_a_400(tiny_llama, adapters):
    # A lone UTF-16 surrogate is valid JSON; as a LoRA name it was listed (the adapter loaded)
    # and the answer naming it could not be encoded: a 500 "internal error:
    # UnicodeEncodeError" for a call that had changed the server's adapters.
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(str(tiny_llama), dtype="float32",
                                       kv_cache_memory_bytes=2 << 20, enable_lora=True,
                                       max_lora_rank=8)
    bad = '"a\\ud800b"'
    with TestClient(build_app(engine, ["base"], allow_runtime_lora_updating=True)) as client:
        for path, body, field in (
                ("/v1/load_lora_adapter",
                 '{"lora_name": %s, "lora_path": "%s"}' % (bad, adapters["alpha"]), "lora_name"),
                ("/v1/load_lora_adapter", '{"lora_name": "x", "lora_path": %s}' % bad,
                 "lora_path"),
                ("/v1/unload_lora_adapter", '{"lora_name": %s}' % bad, "lora_name")):
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == field, (path, r.text)
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base"]


def test_serve_flags():
    import argparse

    from pagedllm.entrypoints.openai.cli_args import (add_serve_args, check_serve_args,
                                                      parse_lora_module)
    from pagedllm.lora.request import LoRAModulePath

    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == \
        LoRAModulePath("x", "/p", "m")
    for bad in ("sql", "=/a", '{"name": "x"}', '{"name": "x", "path": "/p", "r": "8"}', "{"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--lora-modules", "a=/x", "--port", "0"])
    with pytest.raises(ValueError, match="need --enable-lora"):
        check_serve_args(args)


@pytest.mark.slow   # a server start; bad adapters are refused offline in test_lora_refusals
def test_bad_lora_module_stops_the_server_at_start(tiny_llama, tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", str(tiny_llama),
         "--kv-cache-memory-bytes", "2000000", "--enable-lora", "--lora-modules",
         f"broken={tmp_path}", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--lora-modules broken" in result.stderr and "adapter_config.json not found" in \
        result.stderr
