"""The native Gated DeltaNet and gated-attention layer halves (`native/gdn_decoder.py`) against
the module path on a tiny random Qwen3-Next checkpoint (HF's greedy tokens are checked with it on by
tests/models/test_hybrid_models.py)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.native.gdn_decoder import NativeGatedAttention, NativeGDNMixer
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.models.test_hybrid_models import MODELS

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")


@pytest.fixture(autouse=True)
def per_half_path(monkeypatch):
    """These tests count the halves' own calls: no whole-stack call (native/hybrid_stack.py,
    tested by test_hybrid_stack.py) takes their steps."""
    monkeypatch.setattr("pagedllm.native.attach.attach_native_hybrid_stacks", lambda model: 0)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, byte_level_tokenizer_dir):
    arch, config = MODELS["qwen3_next"]
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gdn_native") / "qwen3_next", arch,
                                    byte_level_tokenizer_dir, **config))


def _prompts() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]}
            for n in (37, 9, 21)]


def _layers(llm: LLM) -> list:
    return list(llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers)


def _run(llm: LLM, native: bool, params: SamplingParams, monkeypatch,
         prompts: list[dict] | None = None) -> tuple[list, list[int]]:
    """Outputs of the prompts with the native blocks kept or detached, and the token counts of
    the steps the Gated DeltaNet blocks took."""
    layers = _layers(llm)
    mixers = [layer.native_mixer for layer in layers]
    taken: list[int] = []
    original = NativeGDNMixer.__call__

    def call(self, positions, hidden):
        out = original(self, positions, hidden)
        if out is not None:
            taken.append(hidden.shape[0])
        return out

    monkeypatch.setattr(NativeGDNMixer, "__call__", call)
    original_attention = NativeGatedAttention.__call__

    def call_attention(self, positions, hidden):
        out = original_attention(self, positions, hidden)
        if out is not None:
            taken_attention.append(hidden.shape[0])
        return out

    taken_attention: list[int] = []
    monkeypatch.setattr(NativeGatedAttention, "__call__", call_attention)
    try:
        if not native:
            for layer in layers:
                layer.native_mixer = None
        outputs = llm.generate(prompts or _prompts(), params, use_tqdm=False)
        # each of the 2 Gated DeltaNet layers and the gated-attention layer took each step
        assert len(taken) == 2 * len(taken_attention)
        return outputs, taken
    finally:
        for layer, mixer in zip(layers, mixers):
            layer.native_mixer = mixer


def _chosen_logprobs(output) -> torch.Tensor:
    completion = output.outputs[0]
    return torch.tensor([d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids)])


def _assert_same_greedy(got: list, want: list, atol: float = 3e-5) -> None:
    """Same greedy tokens per request, chosen-token logprobs within `atol`."""
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(_chosen_logprobs(a), _chosen_logprobs(b), atol=atol, rtol=0)


def test_native_mixer_matches_module_path_fp32(qwen3_next, monkeypatch):
    """Batched prefill and decode (with prefix caching's block-boundary checkpoints): the same
    greedy tokens, and logprobs within 3e-5, with the native blocks as without; every layer
    took every step. (The native block runs the four input projections as one GEMM over their
    stacked weight, the module path as four: the same products summed in another order where
    the GEMM picks another tile shape, ~1e-5 on this model's logprobs after 10 tokens.)"""
    llm = LLM(qwen3_next, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert [type(layer.native_mixer) for layer in _layers(llm)] == [
        NativeGDNMixer, NativeGatedAttention, NativeGDNMixer]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    got, taken = _run(llm, True, params, monkeypatch)
    want, none = _run(llm, False, params, monkeypatch)
    assert none == [] and len(taken) >= 2 * 10 and max(taken) > 3   # prefill steps too
    _assert_same_greedy(got, want)


def test_native_blocks_take_long_prefill_steps(qwen3_next, monkeypatch):
    """Prefill steps of several hundred tokens (past the 256 the blocks once declined), with
    chunked prefill splitting a 700-token prompt: the blocks take every step, and greedy tokens
    and logprobs are the module path's."""
    llm = LLM(qwen3_next, dtype="float32", kv_cache_memory_bytes=8 << 20,
              max_num_batched_tokens=512, enable_chunked_prefill=True)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]}
               for n in (700, 300, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    got, taken = _run(llm, True, params, monkeypatch, prompts)
    want, _ = _run(llm, False, params, monkeypatch, prompts)
    assert max(taken) > 256
    _assert_same_greedy(got, want)


def test_stacked_projection_shares_memory_and_follows_weight_updates(qwen3_next, monkeypatch):
    """The GDN block's stacked input projection holds in_proj_qkv's rows itself (the module's
    weight is a view of it, not an inference tensor), and after in-place weight updates and
    `refresh_native_mixers` the native blocks and the module path agree on the new weights."""
    from pagedllm.native.gdn_decoder import refresh_native_mixers
    llm = LLM(qwen3_next, dtype="float32", kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    before, _ = _run(llm, True, params, monkeypatch)
    layer = _layers(llm)[0]
    mixer, stack = layer.linear_attn, layer.native_mixer._keep[-1]
    weight = mixer.in_proj_qkv.weight.data
    assert weight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    assert not weight.is_inference()
    with torch.no_grad():
        for m in (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a):
            m.weight.data.mul_(1.5)
    refresh_native_mixers(llm.llm_engine.engine_core.executor.worker.model_runner.model)
    got, _ = _run(llm, True, params, monkeypatch)
    want, _ = _run(llm, False, params, monkeypatch)
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in before] \
        or any(abs(a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]].logprob
                   - b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]].logprob) > 1e-4
               for a, b in zip(got, before))
    _assert_same_greedy(got, want)


def test_native_mixer_bf16_is_as_accurate_as_module_path(qwen3_next, monkeypatch):
    """bf16: the native mixer keeps its intermediates in float32 (the module path rounds each
    operation's output to bf16): its prompt logprobs' mean error against the float32 module
    path must not exceed the bf16 module path's by more than a margin."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(outputs) -> torch.Tensor:
        return torch.tensor([step[t].logprob for o in outputs
                             for t, step in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])])

    reference = LLM(qwen3_next, dtype="float32", kv_cache_memory_bytes=8 << 20)
    want = prompt_logprobs(_run(reference, False, params, monkeypatch)[0])
    del reference
    llm = LLM(qwen3_next, dtype="bfloat16", kv_cache_memory_bytes=8 << 20)
    native, taken = _run(llm, True, params, monkeypatch)
    assert taken
    module = _run(llm, False, params, monkeypatch)[0]
    native_err = (prompt_logprobs(native) - want).abs().mean().item()
    module_err = (prompt_logprobs(module) - want).abs().mean().item()
    assert native_err <= 1.25 * module_err, (native_err, module_err)
