"""Qwen3-Next / Qwen3.5 multi-step rounds in the native greedy decode loop
(`HybridGreedyDecodeLoop` over the native stack, native/decode_loop.py): the same engine with
the loop switched off (`PAGEDLLM_CPU_DECODE_LOOP=0`, rounds step by step through the stack) and
HF transformers are the oracles, on the tiny random checkpoints of the hybrid model tests
(Gated DeltaNet, gated attention, MoE and dense MLP layers)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.native.decode_loop import HybridGreedyDecodeLoop
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.models.test_hybrid_models import MODELS

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

STEPS, BLOCK = 6, 8     # rounds of 6 steps over blocks of 8 tokens: rounds cross blocks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, byte_level_tokenizer_dir):
    """"qwen3_next" / "qwen3_5" -> tiny random checkpoint folder, built on first use."""
    root = tmp_path_factory.mktemp("qwen3_next_loop")
    paths = {}

    def get(name: str) -> str:
        if name not in paths:
            arch, config = MODELS[name]
            paths[name] = make_tiny_checkpoint(root / name, arch, byte_level_tokenizer_dir,
                                               **config)
        return str(paths[name])

    return get


def _engine(path: str, loop: bool, monkeypatch, **kwargs) -> LLM:
    """An engine with rounds of STEPS steps, the native loop on or off (the environment
    switch, read as the engine starts)."""
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_LOOP", "1" if loop else "0")
    return LLM(path, **{**dict(dtype="float32", kv_cache_memory_bytes=8 << 20,
                               num_scheduler_steps=STEPS, block_size=BLOCK), **kwargs})


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _caches(llm: LLM) -> list[torch.Tensor]:
    """Every state tensor and KV cache of the engine."""
    runner = _runner(llm)
    return list(runner.state_caches) + [layer.kv_cache
                                         for layer in runner.model.attention_layers()]


def _prompts() -> list[dict]:
    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]}
            for n in (29, 7, 18)]


def _tokens(outputs) -> list[tuple[list[int], str]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("dtype,prefix_caching", [("float32", True), ("float32", False),
                                                  ("bfloat16", True)])
def test_loop_bit_identical_to_single_steps(checkpoint, loop_tokens, monkeypatch, dtype,
                                            prefix_caching):
    """3 requests of different lengths and max_tokens (the round capped where the first
    ends), rounds crossing block boundaries: the loop gives the step-by-step path's tokens, and
    afterwards every state slot and KV cache holds the same bits. With prefix caching (mode
    "align": the loop copies the state into each new block's entry, leaving checkpoints) the
    first prompt with 16 of its generated tokens hits the cache at position 40, a checkpoint a
    round wrote, and decodes the first request's next tokens from it."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (20, 9, 15)]
    again = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = []
    for loop in (True, False):
        llm = _engine(checkpoint("qwen3_next"), loop, monkeypatch, dtype=dtype,
                      enable_prefix_caching=prefix_caching)
        assert (_runner(llm).multi_step.native_loop is not None) == loop
        for t in _caches(llm):
            t.zero_()     # (allocated uninitialised: slots never written differ otherwise)
        first = llm.generate(_prompts(), params, use_tqdm=False)
        caches = [t.clone() for t in _caches(llm)]
        longer = _prompts()[0]["prompt_token_ids"] + list(first[0].outputs[0].token_ids[:16])
        second = llm.generate([{"prompt_token_ids": longer}], again, use_tqdm=False)
        results.append((_tokens(first), caches, list(second[0].outputs[0].token_ids),
                        second[0].num_cached_tokens))
        del llm
    (got, got_caches, got_again, hit), (want, want_caches, want_again, want_hit) = results
    assert loop_tokens["tokens"] >= 30
    assert got == want and [len(t) for t, _ in got] == [20, 9, 15]
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    assert got_again == want_again == got[0][0][16:20]
    assert hit == want_hit == (40 if prefix_caching else 0)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_loop_greedy_equals_hf(checkpoint, loop_tokens, monkeypatch, name):
    """One request, float32, prefix caching on: the engine's greedy tokens, most of them
    decoded in the loop, equal HF `generate`'s."""
    path = checkpoint(name)
    prompt = [5 + (7 * i) % 200 for i in range(23)]
    llm = _engine(path, True, monkeypatch)
    got = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    assert loop_tokens["tokens"] >= 10
    extra = {"experts_implementation": "eager"} if name == "qwen3_next" else {}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                           min_new_tokens=16)[0, len(prompt):].tolist()
    assert list(got[0].outputs[0].token_ids) == want


def test_loop_stop_tokens_and_eos_inside_rounds(checkpoint, loop_tokens, monkeypatch,
                                                tmp_path):
    """A stop token and the model's EOS (its generation config set to a token the requests
    reach mid-round) end requests inside rounds: the loop ends its call after that step and
    the others go on; tokens and finish reasons equal the step-by-step path's."""
    path = checkpoint("qwen3_next")
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = _engine(path, False, monkeypatch).generate(_prompts(), plain, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in reference]
    eos_path = tmp_path / "eos"
    shutil.copytree(path, eos_path)
    (eos_path / "generation_config.json").write_text(json.dumps({"eos_token_id": tokens[0][9]}))
    params = [SamplingParams(temperature=0.0, max_tokens=20),
              SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[1][4]]),
              SamplingParams(temperature=0.0, max_tokens=20)]
    results = []
    for loop in (True, False):
        llm = _engine(str(eos_path), loop, monkeypatch)
        results.append(_tokens(llm.generate(_prompts(), params, use_tqdm=False)))
        del llm
    assert loop_tokens["tokens"] > 0
    assert results[0] == results[1]
    reasons = [reason for _, reason in results[0]]
    assert reasons[:2] == ["stop", "stop"]
    assert len(results[0][0][0]) <= 10 and len(results[0][1][0]) <= 5


def test_loop_mixed_batch_and_preemption(checkpoint, loop_tokens, monkeypatch):
    """A batch with a seeded sampling request (rounds step by step while it runs; the loop
    takes them once it is done), two sequence slots for three requests and too few KV blocks
    for both running ones (preemption and recompute): the outputs equal the step-by-step
    path's."""
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    results = []
    for loop in (True, False):
        llm = _engine(checkpoint("qwen3_next"), loop, monkeypatch, block_size=4,
                      num_gpu_blocks_override=22, max_num_seqs=2)
        results.append(_tokens(llm.generate(_prompts(), params, use_tqdm=False)))
        assert llm.get_stats().num_preemptions > 0
        del llm
    assert loop_tokens["tokens"] > 0
    assert results[0] == results[1]


def test_loop_refuses_bad_state_tables(checkpoint, monkeypatch):
    """`run` without the state group's table, with one of another dtype, or (mode "align")
    with a slot outside the state tensors raises a ValueError naming it, before any step."""
    llm = _engine(checkpoint("qwen3_next"), True, monkeypatch)
    loop = _runner(llm).multi_step.native_loop
    assert isinstance(loop, HybridGreedyDecodeLoop) and loop.has_state
    args = (torch.tensor([5]).numpy(), torch.tensor([3]).numpy(),
            torch.ones(1, 4, dtype=torch.int32), BLOCK, 2, [[]])
    with pytest.raises(ValueError, match="state group's block table"):
        loop.run(*args)
    with pytest.raises(ValueError, match="state table must be int32"):
        loop.run(*args, state_table=torch.ones(1, 4, dtype=torch.int64), state_align=True)
    with pytest.raises(ValueError, match="state slot out of range"):
        loop.run(*args, state_table=torch.full((1, 4), 10 ** 6, dtype=torch.int32),
                 state_align=True)
