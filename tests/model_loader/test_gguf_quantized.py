"""GGUF linear weights kept in their blocks (`quantization="gguf"`, layers/quantization/gguf.py)
against the same file dequantized at load (`quantization="none"`, the oracle): greedy tokens on
tiny Llama files, the layers' storage, the automatic choice and its fallback, the raw slices
(row maps, tensor-parallel column slices on block boundaries) and the errors."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.gguf import GGUFLayoutUnsupported, GGUFLinearMethod
from pagedllm.model_loader.gguf import (GGUFSource, dequantize, iterate_gguf_tensors, open_gguf,
                                        prepare_gguf_view, tensor_table)
from pagedllm.model_loader.loader import load_model
from pagedllm.models.fused_decoder import FusedDecoder
from pagedllm.models.llama import unpermute_rope_rows
from tests.fixtures.gguf_files import write_gguf, write_raw_gguf

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("gguf_views")))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def llama_gguf(tiny_checkpoints, tmp_path_factory):
    """llama_gguf(tensor_type) -> the tiny Llama (GQA, Q/K rows permuted) as a .gguf file."""
    root = tmp_path_factory.mktemp("gguf_quantized")
    files = {}

    def get(tensor_type: str):
        if tensor_type not in files:
            files[tensor_type] = write_gguf(tiny_checkpoints["llama"],
                                            root / f"llama-{tensor_type}.gguf", tensor_type)
        return files[tensor_type]

    return get


def _greedy(path, quantization: str | None) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]
    llm = LLM(str(path), quantization=quantization, **ENGINE_ARGS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _load(path, quantization: str | None):
    view = prepare_gguf_view(str(path))
    return load_model(view, AutoConfig.from_pretrained(view), torch.float32,
                      torch.device("cpu"), quantization)


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_greedy_equals_the_dequantized_load(llama_gguf, tensor_type):
    path = llama_gguf(tensor_type)
    assert _greedy(path, "gguf") == _greedy(path, "none")


def test_linear_layers_keep_their_blocks_and_skip_the_fused_decoder(llama_gguf):
    model = _load(llama_gguf("Q4_0"), None)          # the default for a .gguf file
    layer = model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.gguf_quant_type == "Q4_0"
    assert qkv.weight.shape == (qkv.output_size_per_partition, 64 // 32 * 18)
    assert down.weight.shape == (64, 128 // 32 * 18)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert not FusedDecoder.supports(list(model.model.layers))
    plain = _load(llama_gguf("Q4_0"), "none")
    assert plain.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    x = torch.randn(3, 64)
    torch.testing.assert_close(qkv(x), plain.model.layers[0].self_attn.qkv_proj(x),
                               rtol=1e-5, atol=1e-5)


def test_types_without_a_kernel_fall_back_or_are_named(llama_gguf):
    path = llama_gguf("Q5_1")
    model = _load(path, None)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    with pytest.raises(GGUFLayoutUnsupported, match="Q5_1"):
        _load(path, "gguf")


def test_quantization_argument_is_checked(tiny_checkpoints):
    with pytest.raises(ValueError, match="needs a .gguf model"):
        ModelConfig(model=str(tiny_checkpoints["llama"]), quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be"):
        ModelConfig(model="x.gguf", quantization="awq")


@pytest.fixture(scope="module")
def raw_file(tmp_path_factory):
    """A file of two 8 x 64 tensors, Q8_0 and Q4_0; returns {name: GGUFTensor}."""
    rng = np.random.default_rng(0)
    data = {name: rng.standard_normal((8, 64)).astype(np.float32) for name in ("a", "b")}
    path = write_raw_gguf(tmp_path_factory.mktemp("raw") / "raw.gguf", "llama", {
        "a.weight": (gguf.quants.quantize(data["a"], gguf.GGMLQuantizationType.Q8_0), "Q8_0"),
        "b.weight": (gguf.quants.quantize(data["b"], gguf.GGMLQuantizationType.Q4_0), "Q4_0")})
    stat = os.stat(path)
    source = GGUFSource(str(path), "llama", stat.st_size, stat.st_mtime_ns,
                        tensor_table(open_gguf(path)))
    return dict(iterate_gguf_tensors(source, torch.float32))


def test_raw_slices_follow_row_maps_and_block_boundaries(raw_file):
    tensor = raw_file["a.weight"].map(lambda w: unpermute_rope_rows(w, 2))
    raw = tensor.narrow(0, 2, 4).materialize_raw()
    assert raw.dtype == torch.uint8 and raw.shape == (4, 2 * 34)
    torch.testing.assert_close(torch.from_numpy(dequantize(raw.numpy(), "Q8_0")),
                               tensor.narrow(0, 2, 4).materialize(), rtol=0, atol=0)
    cols = raw_file["b.weight"].narrow(1, 32, 32).materialize_raw()
    torch.testing.assert_close(torch.from_numpy(dequantize(cols.numpy(), "Q4_0")),
                               raw_file["b.weight"].materialize()[:, 32:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="block boundaries"):
        raw_file["b.weight"].narrow(1, 16, 32).materialize_raw()
    with pytest.raises(ValueError, match="not a row permutation"):
        raw_file["a.weight"].map(lambda w: w * 2).materialize_raw()


def test_fused_layer_with_mixed_types_and_unaligned_shards_are_refused(raw_file):
    layer = MergedColumnParallelLinear(64, [8, 8])
    layer.set_quant_method(GGUFLinearMethod())
    layer.weight_loader(layer.weight, raw_file["a.weight"], 0)
    with pytest.raises(GGUFLayoutUnsupported, match="Q8_0 and Q4_0"):
        layer.weight_loader(layer.weight, raw_file["b.weight"], 1)
    with pytest.raises(ValueError, match="block boundaries"):
        RowParallelLinear(48, 8).set_quant_method(GGUFLinearMethod())
