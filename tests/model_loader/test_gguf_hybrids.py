"""llama.cpp's GGUF files of the hybrid families: `lfm2` (LFM2 short-conv + attention).

Oracle: the safetensors checkpoint the file was converted from (tests/fixtures/gguf_converted.py
writes what convert_hf_to_gguf.py writes; checked identical, tensor by tensor, with the real
converter of llama-cpp-python 0.3.36 at F32 and Q8_0): greedy tokens equal and logprobs within
1e-4 at F32; a Q8_0 file's linear layers stay in blocks and equal the dequantized load.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_converted import write_converted_gguf
from tests.models.test_hybrid_models import MODELS

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("hybrid_views")))
    patch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")   # exact float activations
    yield
    patch.undo()


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory, byte_level_tokenizer_dir):
    """lfm2(outtype) -> (checkpoint folder, .gguf file)."""
    root = tmp_path_factory.mktemp("lfm2_gguf")
    checkpoint = make_tiny_checkpoint(root / "lfm2", MODELS["lfm2"][0], byte_level_tokenizer_dir,
                                      **MODELS["lfm2"][1])
    return lambda outtype: (checkpoint, write_converted_gguf(
        checkpoint, root / f"lfm2-{outtype}.gguf", outtype))


def _run(model, **kwargs) -> tuple[list[list[int]], list[float], LLM]:
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=g).tolist()}
               for n in (1, 6, 23)]
    llm = LLM(str(model), **{**ENGINE_ARGS, **kwargs})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [step[t].logprob for o in outs
             for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)], llm)


def test_lfm2_f32_file_greedy_equals_the_safetensors_checkpoint(lfm2):
    checkpoint, gguf_file = lfm2("F32")
    want_tokens, want_logprobs, _ = _run(checkpoint)
    tokens, logprobs, llm = _run(gguf_file, quantization="none")
    config = llm.llm_engine.engine_core.executor.worker.model_runner.model.config
    assert list(config.layer_types) == MODELS["lfm2"][1]["layer_types"]
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_lfm2_q8_0_file_stays_in_blocks_and_equals_the_dequantized_load(lfm2):
    _, gguf_file = lfm2("Q8_0")
    tokens, logprobs, llm = _run(gguf_file, quantization="gguf")
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert model.model.layers[0].conv.in_proj.gguf_quant_type == "Q8_0"
    del llm
    want_tokens, want_logprobs, _ = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


def test_lfm2_file_missing_a_tensor_fails_at_load(lfm2, tmp_path):
    checkpoint, _ = lfm2("F32")
    bad = write_converted_gguf(checkpoint, tmp_path / "bad.gguf", "F32",
                               drop_tensors=("blk.2.shortconv.in_proj.weight",))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.conv\.in_proj"):
        LLM(str(bad), quantization="none", **ENGINE_ARGS)
