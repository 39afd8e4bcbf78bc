"""The native DeepSeek / Qwen3-Next decoder stack (`native/hybrid_stack.py`: all layers' two
native halves in one call per step) against the per-half path and HF, on the tiny random
checkpoints of the half tests (DeepSeek V2-Lite / V3 with a dense first layer, Qwen3-Next with
Gated DeltaNet and gated-attention layers)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.native.hybrid_stack import NativeHybridStack
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.models.test_deepseek import build_checkpoint
from tests.models.test_hybrid_models import MODELS

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, byte_level_tokenizer_dir):
    """"v2_lite" / "v3" / "qwen3_next" -> tiny random checkpoint folder, built on first use."""
    root = tmp_path_factory.mktemp("hybrid_stack")
    paths = {}

    def get(name: str) -> str:
        if name not in paths:
            if name == "qwen3_next":
                arch, config = MODELS[name]
                paths[name] = make_tiny_checkpoint(root / name, arch, byte_level_tokenizer_dir,
                                                   **config)
            else:
                paths[name] = build_checkpoint(name, root / name, byte_level_tokenizer_dir)
        return str(paths[name])

    return get


def _model(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.model


def _stack_owner(model):
    """The module whose `layer_stack` is the native stack (the model or its `model`)."""
    return model if isinstance(getattr(model, "layer_stack", None), NativeHybridStack) \
        else model.model


def _prompts() -> list[dict]:
    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]}
            for n in (29, 7, 18)]


def _generate(llm: LLM, stack: bool, monkeypatch, **kwargs) -> tuple[list, list[int]]:
    """Outputs with the stack kept or detached (the per-half path), and the token counts of
    the steps the stack took."""
    owner = _stack_owner(_model(llm))
    native = owner.layer_stack
    assert isinstance(native, NativeHybridStack)
    taken: list[int] = []
    original = NativeHybridStack.__call__

    def call(self, positions, hidden, *args, **kw):
        out = original(self, positions, hidden, *args, **kw)
        if out is not None:
            taken.append(positions.shape[0])
        return out

    monkeypatch.setattr(NativeHybridStack, "__call__", call)
    owner.layer_stack = native if stack else None
    try:
        return llm.generate(_prompts(), SamplingParams(**{**dict(
            temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0), **kwargs}),
                            use_tqdm=False), taken
    finally:
        owner.layer_stack = native
        monkeypatch.setattr(NativeHybridStack, "__call__", original)


def _logprobs(output) -> torch.Tensor:
    return torch.tensor([next(iter(d.values())).logprob for d in output.outputs[0].logprobs])


def _assert_same(got, want, atol: float = 1e-5) -> None:
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(_logprobs(a), _logprobs(b), atol=atol, rtol=0)


@pytest.mark.parametrize("variant", ["v2_lite", "v3", "qwen3_next"])
@pytest.mark.parametrize("steps", [1, 4])
def test_stack_equals_per_half_path(checkpoint, variant, steps, monkeypatch):
    """Batched greedy generation (3 requests, multi-step rounds on and off): the stack takes
    the decode steps and gives the per-half path's tokens and logprobs."""
    llm = LLM(checkpoint(variant), dtype="float32", kv_cache_memory_bytes=8 << 20,
              num_scheduler_steps=steps)
    got, taken = _generate(llm, True, monkeypatch)
    assert taken and 3 in taken   # batched decode steps
    want, none = _generate(llm, False, monkeypatch)
    assert not none
    _assert_same(got, want)


@pytest.mark.parametrize("variant", ["v3", "qwen3_next"])
def test_stack_equals_per_half_path_bf16(checkpoint, variant, monkeypatch):
    """bfloat16: the stack calls the same kernels on the same bf16 buffers (the Qwen3-Next
    residual add rounds once, as torch's), so the per-half path's tokens and logprobs; except
    that DeepSeek's dense first layer runs its MLP in the native kernel where the per-half
    path runs the module (another GEMM summation order, then bf16 rounding): there the
    logprobs agree to 0.1."""
    llm = LLM(checkpoint(variant), dtype="bfloat16", kv_cache_memory_bytes=8 << 20)
    got, taken = _generate(llm, True, monkeypatch)
    assert taken
    want, _ = _generate(llm, False, monkeypatch)
    _assert_same(got, want, atol=1e-5 if variant == "qwen3_next" else 0.1)


@pytest.mark.parametrize("variant", ["v3", "qwen3_next"])
def test_stack_greedy_equals_hf(checkpoint, variant):
    """One request, fp32: the engine's greedy tokens with the stack equal HF `generate`'s."""
    path = checkpoint(variant)
    prompt = [5 + (7 * i) % 200 for i in range(23)]
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert isinstance(_stack_owner(_model(llm)).layer_stack, NativeHybridStack)
    got = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                           min_new_tokens=10)[0, len(prompt):].tolist()
    assert list(got[0].outputs[0].token_ids) == want


@pytest.mark.parametrize("variant", ["v2_lite", "qwen3_next"])
def test_stack_with_prefix_caching(checkpoint, variant, monkeypatch):
    """Prefix caching on, prompts sharing a 32-token prefix (the second batch hits the cache):
    the stack's outputs equal the per-half path's."""
    llm = LLM(checkpoint(variant), dtype="float32", kv_cache_memory_bytes=8 << 20,
              enable_prefix_caching=True)
    prefix = [3 + (11 * i) % 240 for i in range(32)]
    prompts = [{"prompt_token_ids": prefix + [7 + i, 9 + 2 * i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    owner = _stack_owner(_model(llm))
    native = owner.layer_stack
    outs = []
    for stack in (True, False):
        owner.layer_stack = native if stack else None
        llm.generate(prompts[:1], params, use_tqdm=False)   # fills the cache
        outs.append(llm.generate(prompts, params, use_tqdm=False))
    owner.layer_stack = native
    _assert_same(outs[0], outs[1])


def test_stack_declines_where_a_half_declines(checkpoint, monkeypatch):
    """A detached half (one layer's MLA block) makes the stack decline every step; the
    outputs are then the per-half path's."""
    llm = LLM(checkpoint("v3"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    model = _model(llm)
    layer = model.model.layers[1]
    block = layer.native_attention
    want, _ = _generate(llm, False, monkeypatch)
    layer.native_attention = None
    try:
        got, taken = _generate(llm, True, monkeypatch)
    finally:
        layer.native_attention = block
    assert not taken
    _assert_same(got, want)


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_decode_loop_equals_single_steps(checkpoint, variant, loop_tokens):
    """DeepSeek, fp32, 3 requests of different lengths with stop tokens that end some early:
    rounds of 6 steps (their later steps in the native loop) give the tokens, finish reasons
    and logprob-free outputs of single steps, and the loop ran most of the tokens."""
    path = checkpoint(variant)
    single = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20, num_scheduler_steps=1,
                 block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    want = single.generate(_prompts(), params, use_tqdm=False)
    stop = [want[1].outputs[0].token_ids[5]]    # the second request stops at its 6th token
    params_stop = SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=stop)
    want_stop = single.generate(_prompts(), params_stop, use_tqdm=False)
    del single
    multi = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20, num_scheduler_steps=6,
                block_size=8)
    got = multi.generate(_prompts(), params, use_tqdm=False)
    assert loop_tokens["tokens"] >= 20
    got_stop = multi.generate(_prompts(), params_stop, use_tqdm=False)
    for a, b in zip(got + got_stop, want + want_stop):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason


def test_decode_loop_with_prefix_caching_equals_hf(checkpoint, loop_tokens):
    """DeepSeek V3, fp32, prefix caching on, multi-step rounds: a request whose prompt hits
    the cache decodes HF's greedy tokens, most of them in the native loop."""
    path = checkpoint("v3")
    prefix = [3 + (13 * i) % 240 for i in range(24)]
    prompt = prefix + [17, 4, 99]
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20, num_scheduler_steps=8,
              block_size=8, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prefix + [5]}], params, use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert loop_tokens["tokens"] >= 12
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           min_new_tokens=12)[0, len(prompt):].tolist()
    assert list(got[0].outputs[0].token_ids) == want
