"""The served-model-name rule (serving_models.py), the same for the generation and pooling servers:
`--served-model-name` values if given, otherwise `--model` exactly as passed."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from pagedllm.assets import DEFAULT_MODEL_NAME
from pagedllm.entrypoints.openai.serving_models import resolve_served_model_names
from tests.entrypoints.openai.server_process import running_server


def test_resolve_served_model_names() -> None:
    assert resolve_served_model_names("org/model", ["a", "b", "a"]) == ["a", "b"]
    assert resolve_served_model_names("./ckpt/", None) == ["./ckpt/"]
    assert resolve_served_model_names("/abs/ckpt", []) == ["/abs/ckpt"]
    assert resolve_served_model_names(None, None) == [DEFAULT_MODEL_NAME]
    assert resolve_served_model_names(None, ["x"]) == ["x"]
    with pytest.raises(ValueError, match="non-empty"):
        resolve_served_model_names("m", [" "])


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["generate", "pooling"])
def test_served_name_is_the_model_argument_as_given(tiny_llama: Path, runner: str) -> None:
    # A relative path, not the folder's name nor its absolute path: what the user typed.
    model = os.path.relpath(tiny_llama)
    args = ["--model", model, "--runner", runner, "--dtype", "float32", "--max-model-len", "128",
            "--kv-cache-memory-bytes", "2000000", "--uvicorn-log-level", "warning"]
    with running_server(args) as (_, url):
        cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c["max_model_len"]) for c in cards] == [(model, 128)]
        ok = httpx.post(url + "/tokenize", json={"model": model, "prompt": "hi"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["max_model_len"] == 128
        for other in (tiny_llama.name, str(tiny_llama)):
            r = httpx.post(url + "/tokenize", json={"model": other, "prompt": "hi"}, timeout=10)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
