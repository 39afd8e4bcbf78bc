"""llama.cpp's GGUF files of the hybrid families: `lfm2` (LFM2 short-conv + attention) and
`mamba2` (its config read from the file's `mamba2.ssm.*` keys).

Oracle: the safetensors checkpoint the file was converted from (tests/fixtures/gguf_converted.py
writes what convert_hf_to_gguf.py writes; checked identical, tensor by tensor, with the real
converter of llama-cpp-python 0.3.36 at F32 and Q8_0): greedy tokens equal and logprobs within
1e-4 at F32; a Q8_0 file's linear layers stay in blocks and equal the dequantized load;
malformed files fail at load naming the tensor or key.
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
def files(tmp_path_factory, byte_level_tokenizer_dir):
    """files(family, outtype) -> (checkpoint folder, .gguf file), built on first use."""
    root = tmp_path_factory.mktemp("hybrid_gguf")
    checkpoints: dict = {}

    def get(family: str, outtype: str = "F32"):
        if family not in checkpoints:
            checkpoints[family] = make_tiny_checkpoint(root / family, MODELS[family][0],
                                                       byte_level_tokenizer_dir,
                                                       **MODELS[family][1])
        out = root / f"{family}-{outtype}.gguf"
        if not out.exists():
            write_converted_gguf(checkpoints[family], out, outtype)
        return checkpoints[family], out

    return get


def _run(model, **kwargs) -> tuple[list[list[int]], list[float], LLM]:
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=g).tolist()}
               for n in (1, 6, 23)]
    llm = LLM(str(model), **{**ENGINE_ARGS, **kwargs})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [step[t].logprob for o in outs
             for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)], llm)


@pytest.mark.parametrize("family", ["lfm2", "mamba2"])
def test_f32_file_greedy_equals_the_safetensors_checkpoint(files, family):
    checkpoint, gguf_file = files(family)
    want_tokens, want_logprobs, _ = _run(checkpoint)
    tokens, logprobs, llm = _run(gguf_file, quantization="none")
    config = llm.llm_engine.engine_core.executor.worker.model_runner.model.config
    if family == "lfm2":
        assert list(config.layer_types) == MODELS["lfm2"][1]["layer_types"]
    else:
        assert (config.num_heads, config.n_groups, config.state_size) == (8, 2, 16)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
@pytest.mark.parametrize("family", ["lfm2", "mamba2"])
def test_q8_0_file_stays_in_blocks_and_equals_the_dequantized_load(files, family):
    _, gguf_file = files(family, "Q8_0")
    tokens, logprobs, llm = _run(gguf_file, quantization="gguf")
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    linear = (model.model.layers[0].conv.in_proj if family == "lfm2"
              else model.backbone.layers[0].mixer.in_proj)
    assert linear.gguf_quant_type == "Q8_0"
    del llm
    want_tokens, want_logprobs, _ = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("family,change,message", [
    ("lfm2", dict(drop_tensors=("blk.2.shortconv.in_proj.weight",)),
     r"model\.layers\.2\.conv\.in_proj"),
    ("mamba2", dict(drop_tensors=("blk.1.ssm_a",)), r"backbone\.layers\.1\.mixer\.A_log"),
    ("mamba2", dict(metadata_overrides={"mamba2.ssm.inner_size": None}),
     r"mamba2\.ssm\.inner_size"),
])
def test_malformed_file_fails_at_load_naming_it(files, tmp_path, family, change, message):
    checkpoint, _ = files(family)
    bad = write_converted_gguf(checkpoint, tmp_path / "bad.gguf", "F32", **change)
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), quantization="none", **ENGINE_ARGS)
