"""llama.cpp's `qwen3moe` GGUF files: the config completed beyond transformers' reading
(expert size, norm_topk_prob), stacked experts loaded per expert and kept in their GGUF blocks.

Oracle: the safetensors checkpoint the file was converted from (tests/fixtures/gguf_converted.py,
checked identical with llama.cpp's converter at F32 and Q8_0): greedy tokens equal and logprobs
within 1e-4 at F32; Q8_0 experts in blocks equal the same file loaded dequantized.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.gguf_converted import write_converted_gguf
from tests.models.test_moe import _build

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("qwen_moe_views")))
    patch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")   # exact float activations
    yield
    patch.undo()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, byte_level_tokenizer_dir):
    """qwen3_moe(outtype) -> (checkpoint folder, .gguf file)."""
    root = tmp_path_factory.mktemp("qwen3_moe_gguf")
    checkpoint = _build("qwen3_moe", root / "qwen3_moe", byte_level_tokenizer_dir)
    return lambda outtype: (checkpoint, write_converted_gguf(
        checkpoint, root / f"qwen3_moe-{outtype}.gguf", outtype))


def _run(model, **kwargs):
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=g).tolist()}
               for n in (1, 6, 23)]
    llm = LLM(str(model), **{**ENGINE_ARGS, **kwargs})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [step[t].logprob for o in outs
             for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)], llm)


def test_f32_file_greedy_equals_the_safetensors_checkpoint(qwen3_moe):
    checkpoint, gguf_file = qwen3_moe("F32")
    want_tokens, want_logprobs, _ = _run(checkpoint)
    tokens, logprobs, llm = _run(gguf_file, quantization="none")
    config = llm.llm_engine.engine_core.executor.worker.model_runner.model.config
    assert (config.moe_intermediate_size, config.norm_topk_prob) == (32, True)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_q8_0_experts_stay_in_blocks_and_equal_the_dequantized_load(qwen3_moe):
    _, gguf_file = qwen3_moe("Q8_0")
    tokens, logprobs, llm = _run(gguf_file)          # the default: quantization "gguf"
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.gguf_expert_types == {"w13": "Q8_0", "w2": "Q8_0"} for m in moes)
    del llm
    want_tokens, want_logprobs, _ = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)
