"""The issue's case: the same seeded request sent twice to the server, the second a prefix-cache
hit, must give the same text and logprobs; with `batch_invariant` it does, bit for bit, also
while other requests share its steps (through the `openai` client, app in-process).
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from fastapi.testclient import TestClient

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

MODEL = "tiny"
# A prompt of ~550 tokens: its second run hits the cache on all but its last partial block,
# which the default mode computes on another attention path than the whole prompt's.
PROMPT = " ".join(f"The {w} fox jumps over the lazy dog {n} times while the old man reads."
                  for n, w in enumerate(["quick", "brown", "red", "old", "sly", "tired"] * 3))


@pytest.fixture(scope="module")
def client(tmp_path_factory, byte_level_tokenizer_dir):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("bis") / "llama",
                                      "LlamaForCausalLM", byte_level_tokenizer_dir,
                                      hidden_size=256, intermediate_size=512,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      initializer_range=0.05)
    gguf = write_gguf(checkpoint, tmp_path_factory.mktemp("bis_gguf") / "m.gguf", "Q8_0")
    async_llm = AsyncLLM.from_engine_args(str(gguf), batch_invariant=True,
                                          kv_cache_memory_bytes=8 << 20)
    test_client = TestClient(build_app(async_llm, [MODEL]))
    test_client.__enter__()
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                        http_client=test_client, max_retries=0)
    test_client.__exit__(None, None, None)


def _completion(client, prompt: str, seed: int = 7):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.9,
                                    seed=seed, logprobs=3, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


def test_same_seeded_request_twice_and_alongside_others(client):
    first = _completion(client, PROMPT)
    second = _completion(client, PROMPT)   # a prefix-cache hit
    assert second == first
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(_completion, client, PROMPT[:n] + " and so on", n)
                  for n in (10, 30, 50)]
        third = pool.submit(_completion, client, PROMPT).result()
        for f in others:
            f.result()
    assert third == first
