"""LoRA on the native CPU paths: the fused decoder applies each step's adapters inside its
layers (csrc/lora_kernel.h after each of its four linears) and the native greedy decode loop
takes adapter requests' multi-step rounds; both give the module path's tokens and logprobs
(fp32, a mixed batch of base rows and three adapters of ranks 4, 8 and 16, one on attention
only). tests/lora/test_lora_e2e.py compares the default (native) path with HF + peft."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.native.attach import NativeDecoderStack
from tests.lora.adapters import make_adapters

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    adapters = make_adapters(tiny_llama, tmp_path_factory.mktemp("lora_native"))
    loras = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]}
               for n in (9, 30, 4, 22, 15, 40)]
    return tiny_llama, [None, loras[0], loras[1], loras[2], loras[0], None], prompts


def _engine(base, **kwargs) -> LLM:
    return LLM(str(base), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True,
               max_loras=3, max_lora_rank=16, **kwargs)


def _outputs(outs):
    return [(list(o.outputs[0].token_ids),
             [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_fused_decoder_and_decode_loop_match_module_path(setup, monkeypatch):
    base, per_prompt, prompts = setup
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = _engine(base, num_scheduler_steps=4)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    # The adapters went into the native stack (not a gate around it) and the native decode loop
    # takes the rounds.
    assert isinstance(runner.model.model.layer_stack, NativeDecoderStack)
    assert runner.multi_step.native_loop is not None
    native = _outputs(llm.generate(prompts, with_logprobs, use_tqdm=False,
                                   lora_request=per_prompt))
    native_loop = [list(o.outputs[0].token_ids) for o in llm.generate(
        prompts, greedy, use_tqdm=False, lora_request=per_prompt)]
    del llm
    monkeypatch.setenv("PAGEDLLM_CPU_FUSED_DECODER", "0")
    module = _outputs(_engine(base).generate(prompts, with_logprobs, use_tqdm=False,
                                             lora_request=per_prompt))
    assert [t for t, _ in native] == [t for t, _ in module] == native_loop
    assert len({tuple(t) for t, _ in module}) > 2            # the adapters change the tokens
    for (_, got), (_, want) in zip(native, module):
        assert got == pytest.approx(want, abs=1e-4)
