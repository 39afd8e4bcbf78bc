"""Mistral, Qwen2 and Qwen3 sliding-window checkpoints end to end, on tiny random checkpoints
whose windows (8 or 16 tokens) are shorter than the prompts: Mistral slides on every layer,
Qwen2/Qwen3 (use_sliding_window) on the layers HF's `layer_types` / `max_window_layers` pick.

Oracles (DESIGN.md §6): HF `transformers` in fp32 (greedy tokens equal, logprobs of the generated
and of the prompt tokens within fp32 noise) with both CPU attention backends (the default one runs
the fused CPU decoder for the steps whose sequences fit in the window); and the engine against
itself (chunked prefill, prefix caching with shared prefixes longer than the window, small blocks).
"""

from __future__ import annotations

import pytest
import transformers

from pagedllm import LLM
from pagedllm.config import create_engine_config
from pagedllm.layers.attention import Attention
from pagedllm.native.fused_decoder import FusedDecoder
from pagedllm.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                   Qwen3ForCausalLM, layer_sliding_windows)
from tests.models import test_gemma as gemma_tests
from tests.models.test_gemma import BACKENDS, _params, assert_matches_hf

# variant -> each layer's window, as HF's config defines it
WINDOWS = {"mistral_sliding": [8, 8, 8], "qwen2_sliding": [None, 16, 16],
           "qwen3_sliding": [8, None, 8]}
VARIANTS = list(WINDOWS)

hf_reference = gemma_tests.hf_reference


def _layers(llm) -> list[Attention]:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_logprobs_match_hf(tiny_checkpoints, hf_reference, variant, backend,
                                      monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
    want_tokens, want_logprobs, want_prompt_logprobs = hf_reference(variant)
    llm = LLM(str(tiny_checkpoints[variant]), dtype="float32", kv_cache_memory_bytes=8 << 20)
    layers = _layers(llm)
    assert {m.backend.name for m in layers} == {backend}
    assert [m.sliding_window for m in layers] == WINDOWS[variant]
    assert_matches_hf(llm, want_tokens, want_logprobs, want_prompt_logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["mistral_sliding", "qwen2_sliding"])
def test_chunked_prefill_and_prefix_caching_change_nothing(tiny_checkpoints, variant, backend,
                                                           monkeypatch):
    gemma_tests.test_chunked_prefill_and_prefix_caching_change_nothing(
        tiny_checkpoints, variant, backend, monkeypatch)


@pytest.mark.parametrize("variant", VARIANTS)
def test_context_is_not_capped_at_the_window(tiny_checkpoints, variant):
    config = create_engine_config(str(tiny_checkpoints[variant]))
    assert config.max_model_len == 1024
    assert create_engine_config(str(tiny_checkpoints[variant]),
                                max_model_len=512).max_model_len == 512


def test_fused_decoder_takes_steps_within_the_window(tiny_checkpoints, monkeypatch):
    """The fused CPU decoder stays on for a windowed model: steps whose sequences fit in the
    smallest window take it, longer ones run the module path (same tokens either way)."""
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "cpu_paged")
    llm = LLM(str(tiny_checkpoints["mistral_sliding"]), dtype="float32",
              kv_cache_memory_bytes=8 << 20)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    if model.model.layer_stack is None:
        pytest.skip("the fused CPU decoder is not available here")
    fused = model.model.layer_stack.fused
    assert fused.min_window == 8
    seq_lens: list[int] = []
    call = FusedDecoder.__call__

    def spy(self, positions, residual, delta, metadata, *rest):
        seq_lens.append(int(metadata.seq_lens.max()))
        return call(self, positions, residual, delta, metadata, *rest)

    monkeypatch.setattr(FusedDecoder, "__call__", spy)
    llm.generate([[5, 6, 7]], _params(), use_tqdm=False)  # 3 + 8 tokens: past the window
    assert seq_lens and max(seq_lens) <= 8


@pytest.mark.parametrize("kwargs, family, want", [
    # HF's Qwen rule without layer_types (transformers 4 configs): layer i slides when
    # i >= max_window_layers.
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
     Qwen2ForCausalLM, [None, None, 16, 16]),
    ({"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0},
     Qwen2ForCausalLM, [None] * 4),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
     Qwen3ForCausalLM, [None, None, None, 8]),
    ({"sliding_window": 32}, MistralForCausalLM, [32] * 4),
    ({"sliding_window": None}, MistralForCausalLM, [None] * 4),
    ({}, LlamaForCausalLM, [None] * 4),
])
def test_layer_windows_follow_hf(kwargs, family, want):
    config_class = {Qwen2ForCausalLM: transformers.Qwen2Config,
                    Qwen3ForCausalLM: transformers.Qwen3Config,
                    MistralForCausalLM: transformers.MistralConfig,
                    LlamaForCausalLM: transformers.LlamaConfig}[family]
    config = config_class(num_hidden_layers=4, **kwargs)
    assert layer_sliding_windows(config, family) == want
    if hasattr(config, "layer_types"):  # HF's own per-layer choice agrees
        hf = [config.sliding_window if t == "sliding_attention" else None
              for t in config.layer_types]
        if family is not MistralForCausalLM:
            assert hf == want
        del config.layer_types  # the max_window_layers rule alone gives the same
        assert layer_sliding_windows(config, family) == want
