"""A causal LM as embedder (Qwen3-Embedding style): last-token / mean pooling over the final
hidden states of our Llama through the pooling runner, against transformers' AutoModel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pagedllm import LLM, PoolingParams

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog " * 3, "x",
           "Embeddings from a decoder"]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), runner="pooling", dtype="float32", max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama: Path, llm: LLM) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    with torch.no_grad():
        return [model(torch.tensor([tok(p).input_ids])).last_hidden_state[0] for p in PROMPTS]


def test_default_is_normalized_last_token(llm: LLM, hf_hidden) -> None:
    got = np.array([o.outputs.embedding for o in llm.embed(PROMPTS)])
    want = torch.stack([torch.nn.functional.normalize(h[-1], dim=-1) for h in hf_hidden])
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)


def test_mean_and_last_unnormalized_match_hf(llm: LLM, hf_hidden) -> None:
    mean = llm.embed(PROMPTS, PoolingParams(pooling_type="MEAN", normalize=False))
    last = [llm.embed(p, PoolingParams(pooling_type="LAST", normalize=False))[0]
            for p in PROMPTS]
    # fp32 with another summation order (the engine's CPU linear kernel): ~1e-5 apart
    for h, m, l in zip(hf_hidden, mean, last):
        np.testing.assert_allclose(m.outputs.embedding, h.mean(0).numpy(), atol=5e-5)
        np.testing.assert_allclose(l.outputs.embedding, h[-1].numpy(), atol=5e-5)


@pytest.mark.parametrize("kwargs, named", [
    ({"enable_lora": True}, "enable_lora"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative_config"),
    ({"kv_offloading_size": 0.01}, "kv_transfer_config"),
    ({"enable_sleep_mode": True}, "enable_sleep_mode"),
])
def test_generation_only_features_are_refused_by_the_pooling_runner(tiny_llama: Path, kwargs,
                                                                    named) -> None:
    # They were accepted and silently unused: `serve --runner pooling --enable-lora
    # --lora-modules a=...` started and served no adapter `a`.
    with pytest.raises(ValueError, match=f"{named} .*runner='pooling'"):
        LLM(str(tiny_llama), runner="pooling", dtype="float32", max_model_len=64, **kwargs)
