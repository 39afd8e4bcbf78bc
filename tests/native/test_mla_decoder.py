"""The native MLA attention block (`native/mla_decoder.py`) against the module path and HF, on
tiny random DeepSeek-V2 (no q_lora, YaRN) and DeepSeek-V3 (q_lora) checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.core.sched_output import NewRequestData
from pagedllm.native.kernels import cpu_kernels
from pagedllm.native.mla_decoder import NativeMLABlock
from tests.fixtures.runner_steps import run_step
from tests.models.test_deepseek import build_checkpoint

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

# "v3+8heads": 8 query heads on a 64-value latent (L 48 + dr 16): the shapes of the kernel's
# two-pass eight-head decode (AVX-512 builds), which skips the latent's k_pe channels in the
# values the block reads.
EXTRA = {"8heads": dict(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=48,
                        qk_rope_head_dim=16)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(autouse=True)
def per_half_path(monkeypatch):
    """These tests count the halves' own calls: no whole-stack call (native/hybrid_stack.py,
    tested by test_hybrid_stack.py) takes their steps."""
    monkeypatch.setattr("pagedllm.native.attach.attach_native_hybrid_stacks", lambda model: 0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, byte_level_tokenizer_dir):
    """variant ("v2_lite", "v3") -> tiny random checkpoint folder, built on first use."""
    root = tmp_path_factory.mktemp("mla_native")
    paths = {}

    def get(name: str):
        if name not in paths:
            base, _, extra = name.partition("+")
            paths[name] = build_checkpoint(base, root / name, byte_level_tokenizer_dir,
                                           EXTRA.get(extra))
        return paths[name]

    return get


def _layers(llm: LLM) -> list:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return [layer for layer in model.model.layers]


def _counting(monkeypatch) -> list[int]:
    """Patch NativeMLABlock.__call__ to record the token count of every step it took."""
    taken: list[int] = []
    original = NativeMLABlock.__call__

    def call(self, positions, hidden, residual):
        out = original(self, positions, hidden, residual)
        if out is not None:
            taken.append(positions.shape[0])
        return out

    monkeypatch.setattr(NativeMLABlock, "__call__", call)
    return taken


def _continuation_logits(llm: LLM, tokens: list[int], prefix: int, native: bool):
    """Prefill tokens[:prefix] on the module path, then tokens[prefix:] as one continuation
    step over the cached prefix (absorbed rows) with the native block on or off; its logits
    [len(tokens) - prefix, vocab]."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    layers = _layers(llm)
    blocks = [layer.native_attention for layer in layers]
    assert all(isinstance(b, NativeMLABlock) for b in blocks)
    table = list(range(1, 1 + -(-len(tokens) // runner.block_size)))
    try:
        for layer in layers:
            layer.native_attention = None
        run_step(runner, NewRequestData("prefill", tokens, [], GREEDY, table, 0), prefix)
        for layer, block in zip(layers, blocks):
            layer.native_attention = block if native else None
        return run_step(runner, NewRequestData("continue", tokens, [], GREEDY, table, prefix),
                        len(tokens) - prefix)
    finally:
        for layer, block in zip(layers, blocks):
            layer.native_attention = block


def _native_module_and_hf(path, dtype: str, monkeypatch, length: int = 45, prefix: int = 37):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(str(path), dtype=dtype, kv_cache_memory_bytes=8 << 20)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, hf.config.vocab_size, (length,), generator=g).tolist()
    taken = _counting(monkeypatch)
    native = _continuation_logits(llm, tokens, prefix, native=True)
    assert taken == [length - prefix] * hf.config.num_hidden_layers   # every layer, one call
    module = _continuation_logits(llm, tokens, prefix, native=False)
    assert len(taken) == hf.config.num_hidden_layers
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0, prefix:]
    return native, module, want


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_native_block_matches_module_path_and_hf_fp32(checkpoint, variant, monkeypatch):
    """An 8-token continuation over a 37-token cached prefix (absorbed, causal within the
    chunk): the native block's logits equal the module path's and HF's to float32 rounding."""
    native, module, want = _native_module_and_hf(checkpoint(variant), "float32", monkeypatch)
    torch.testing.assert_close(native, module, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(native, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_native_block_bf16_is_as_accurate_as_module_path(checkpoint, variant, monkeypatch):
    """bf16: the native block keeps its intermediates in float32 (the module path rounds each
    operation's output to bf16), so it is compared by its mean error against HF in float32,
    which must not exceed the module path's by more than a margin."""
    native, module, want = _native_module_and_hf(checkpoint(variant), "bfloat16", monkeypatch)
    native_err = (native.float() - want).abs().mean().item()
    module_err = (module.float() - want).abs().mean().item()
    assert native_err <= 1.25 * module_err, (native_err, module_err)
    assert (native.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.85


@pytest.mark.parametrize("variant", ["v3", "v3+8heads"])
def test_generation_with_native_block_equals_without(checkpoint, variant, monkeypatch):
    """End to end, fp32: batched decode (3 requests) with prefill steps declined (fresh
    prompts run expanded on the module path): the same greedy tokens and logprobs (1e-5) with
    the native block as without it (`PAGEDLLM_CPU_NATIVE_ATTENTION` off: none attached)."""
    path = str(checkpoint(variant))
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 3 * i))} for i in range(3)]
    taken = _counting(monkeypatch)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert taken and set(taken) <= {1, 2, 3}   # decode steps only
    del llm
    monkeypatch.setenv("PAGEDLLM_CPU_NATIVE_ATTENTION", "0")
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert all(layer.native_attention is None for layer in _layers(llm))
    want = llm.generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(
            torch.tensor([next(iter(d.values())).logprob for d in a.outputs[0].logprobs]),
            torch.tensor([next(iter(d.values())).logprob for d in b.outputs[0].logprobs]),
            atol=1e-5, rtol=0)
    if variant == "v3":
        return
    # and HF's greedy tokens (the decodes of the eight-head shapes run two-pass in both paths)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, a in zip(prompts, got):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        with torch.inference_mode():
            ref = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              min_new_tokens=GREEDY.max_tokens)[0, ids.shape[1]:]
        assert a.outputs[0].token_ids == ref.tolist()
