"""`pagedllm serve` on a model without a chat template warns before the model loads and keeps
serving completions; chat requests get a 400 naming `messages` (issue #40)."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.server_process import running_server
from tests.fixtures.gguf_files import write_gguf


@pytest.mark.slow
def test_serve_warns_at_start_up_and_serves_completions(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / "no_template.gguf", "Q8_0", add_chat_template=False)
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr, running_server(
            ["--model", str(path), "--kv-cache-memory", str(4 << 20)], stderr=stderr,
            env={"PAGEDLLM_GGUF_CACHE": str(tmp_path / "views")}) as (_, url):
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                timeout=60)
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert completion.status_code == 200
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    lines = log.read_text().splitlines()
    warning = next(i for i, line in enumerate(lines) if "has no chat template" in line)
    assert "--chat-template FILE" in lines[warning] and str(path) in lines[warning]
    # Before the engine was built: the warning precedes the KV cache and ready lines.
    assert warning < next(i for i, line in enumerate(lines) if "engine ready" in line)
