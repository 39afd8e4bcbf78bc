"""The offline API surface: prompt forms, chat, dtypes, hub ids from the local cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=8 << 20)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    text = ["Once upon a time", "the café was naïve 🙂"]
    ids = [tok(t).input_ids for t in text]
    by_text = llm.generate(text, GREEDY, use_tqdm=False)
    by_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    by_dict = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    single = llm.generate(text[1], GREEDY, use_tqdm=False)
    assert [o.prompt for o in by_text] == text
    assert [o.prompt_token_ids for o in by_text] == ids
    tokens = [o.outputs[0].token_ids for o in by_text]
    assert tokens == [o.outputs[0].token_ids for o in by_ids]
    assert tokens == [o.outputs[0].token_ids for o in by_dict]
    assert single[0].outputs[0].token_ids == tokens[1]
    out = by_text[0].outputs[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert by_text[0].finished and out.finish_reason == "length"


def test_one_params_per_prompt(llm):
    outs = llm.generate([[5, 6], [7, 8]], [SamplingParams(temperature=0.0, max_tokens=2),
                                           SamplingParams(temperature=0.0, max_tokens=5,
                                                          ignore_eos=True)], use_tqdm=False)
    assert len(outs[1].outputs[0].token_ids) == 5
    assert len(outs[0].outputs[0].token_ids) <= 2
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[5, 6], [7, 8]], [GREEDY], use_tqdm=False)


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == list(ids)
    plain = llm.generate([list(ids)], GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_dtypes_run(tiny_checkpoints, dtype):
    llm = LLM(str(tiny_checkpoints["llama"]), dtype=dtype, kv_cache_memory_bytes=4 << 20)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.model.lm_head.weight.dtype == getattr(torch, dtype)
    assert runner.kv_caches[0].dtype == getattr(torch, dtype)
    out = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6


def test_hub_id_from_offline_cache(tiny_checkpoints, tmp_path):
    """A hub id resolves from the huggingface_hub cache with HF_HUB_OFFLINE=1 (a subprocess,
    since huggingface_hub reads its environment at import)."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_checkpoints["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = textwrap.dedent("""
        from pagedllm import LLM, SamplingParams
        llm = LLM("tiny-org/tiny-llama", dtype="float32", kv_cache_memory_bytes=4 << 20)
        out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        print("TOKENS", len(out[0].outputs[0].token_ids))
        try:
            LLM("tiny-org/missing", dtype="float32")
        except FileNotFoundError as e:
            print("MISSING", "tiny-org/missing" in str(e))
    """)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "TOKENS 3" in proc.stdout, proc.stderr[-2000:]
    assert "MISSING True" in proc.stdout, proc.stderr[-2000:]
