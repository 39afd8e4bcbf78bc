"""Float checkpoints quantized to int8 at load (`quantization="int8"` / `"w8a8"`,
layers/quantization/int8.py), against fake-quantized oracles on the tiny Llama:

- int8 (weight-only): greedy tokens equal an engine run on a checkpoint whose linear weights were
  quantized and dequantized in float32 (the same numbers, computed as float weights);
- w8a8: prompt logprobs close to HF transformers with every linear layer swapped for a
  quantize-dequantize module (weights per channel, activations per token);
- the fused CPU decoder against the module path (int8 and w8a8; AVX2 and portable builds);
- the layers' storage and the refusal for .gguf models.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.native.kernels import cpu_kernels
from pagedllm.layers.quantization.int8 import (Int8LinearMethod, quantize_activations_per_token,
                                               quantize_weight_per_channel)
from pagedllm.model_loader.loader import load_model
from pagedllm.native.fused_decoder import FusedDecoder
from tests.fixtures.kernel_builds import kernel_build
from tests.native.test_fused_decoder import _continuation_logits

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    qweight, scale = quantize_weight_per_channel(weight)
    return qweight.float() * scale[:, None]


def _fake_quant_checkpoint(src, out, row_parallel_shards: int = 1):
    """`src` with each linear weight replaced by its int8 quantize-dequantize; the row-parallel
    ones (o_proj, down_proj) per slice of `row_parallel_shards` input-column slices, as
    tensor-parallel ranks quantize their shards."""
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)

    def fake(name: str, t: torch.Tensor) -> torch.Tensor:
        kind = name.rsplit(".", 2)[-2]
        if kind not in PROJECTIONS:
            return t
        shards = row_parallel_shards if kind in ("o_proj", "down_proj") else 1
        return torch.cat([_dequantized(c) for c in t.chunk(shards, dim=1)], dim=1)

    for path in src.glob("*.safetensors"):
        save_file({name: fake(name, t) for name, t in load_file(path).items()},
                  out / path.name, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def fake_quant_llama(tiny_llama, tmp_path_factory):
    """The tiny Llama with each linear weight replaced by its int8 quantize-dequantize."""
    return _fake_quant_checkpoint(tiny_llama, tmp_path_factory.mktemp("int8_fake_quant"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]


def _greedy(path, quantization: str | None) -> list[list[int]]:
    llm = LLM(str(path), quantization=quantization, **ENGINE_ARGS)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy_counting_fused_steps(path, quantization: str, fused: bool,
                                 monkeypatch) -> tuple[list[list[int]], int]:
    """Greedy tokens of `_prompts()` with the fused decoder switched on or off, and how many
    steps it ran."""
    calls = []
    original = FusedDecoder.__call__

    def counting(self, *args, **kwargs):
        calls.append(args[1].shape[0])
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setenv("PAGEDLLM_CPU_FUSED_DECODER", "1" if fused else "0")
        # One call per step: the native decode loop (native/decode_loop.py) runs multi-step
        # rounds' later steps without calling FusedDecoder.
        patch.setenv("PAGEDLLM_CPU_DECODE_LOOP", "0")
        patch.setattr(FusedDecoder, "__call__", counting)
        tokens = _greedy(path, quantization)
    return tokens, len(calls)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_fused_decoder_equals_the_module_path(tiny_llama, monkeypatch, quantization):
    """The fused decoder runs int8 / w8a8 layers with the module path's kernels
    (csrc/int8_blocks.h, same work split, so each linear gives the same sums for the same
    input); the rest of the layer (norms, RoPE, attention) sums in another order, so logits
    agree to float32 tolerance, not bitwise, and greedy tokens are equal."""
    fused, fused_steps = _greedy_counting_fused_steps(tiny_llama, quantization, True, monkeypatch)
    module, module_steps = _greedy_counting_fused_steps(tiny_llama, quantization, False,
                                                        monkeypatch)
    assert fused == module
    assert module_steps == 0 and fused_steps >= GREEDY.max_tokens - 1   # the decode steps
    llm = LLM(str(tiny_llama), quantization=quantization, **ENGINE_ARGS)
    tokens = torch.randint(3, 200, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    got = _continuation_logits(llm, tokens, 21, fused=True)     # asserts the fused step ran
    want = _continuation_logits(llm, tokens, 21, fused=False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def portable_kernels():
    """The kernel library built without AVX2/FMA (the scalar int8 code paths)."""
    return kernel_build("portable")


@pytest.mark.slow   # builds the portable kernel library
@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_portable_fused_decoder_equals_the_module_path(tiny_llama, portable_kernels,
                                                       monkeypatch, quantization):
    import pagedllm.attention.backends.cpu_paged as cpu_paged
    import pagedllm.native.kernels.ops as ops
    import pagedllm.native.fused_decoder as fused_decoder

    for module in (ops, cpu_paged, fused_decoder):
        monkeypatch.setattr(module, "cpu_kernels", lambda: portable_kernels)
    llm = LLM(str(tiny_llama), quantization=quantization, **ENGINE_ARGS)
    tokens = torch.randint(3, 200, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    got = _continuation_logits(llm, tokens, 26, fused=True)
    want = _continuation_logits(llm, tokens, 26, fused=False)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int8_greedy_equals_the_fake_quantized_checkpoint(tiny_llama, fake_quant_llama):
    quantized = _greedy(tiny_llama, "int8")
    assert quantized == _greedy(fake_quant_llama, "none")
    assert quantized != _greedy(tiny_llama, "none")      # the oracle tells the two apart


def test_int8_layers_store_int8_and_take_the_fused_decoder(tiny_llama):
    config = AutoConfig.from_pretrained(tiny_llama)
    model = load_model(str(tiny_llama), config, torch.float32, torch.device("cpu"), "int8")
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    layer, hf_layer = model.model.layers[1], reference.model.layers[1]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Int8LinearMethod)
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.dtype == torch.float32
    assert qkv.weight.shape == (qkv.output_size_per_partition, config.hidden_size)
    want_q, want_scale = quantize_weight_per_channel(torch.cat(
        [hf_layer.self_attn.q_proj.weight, hf_layer.self_attn.k_proj.weight,
         hf_layer.self_attn.v_proj.weight]))
    assert torch.equal(qkv.weight, want_q) and torch.equal(qkv.weight_scale, want_scale)
    x = torch.randn(3, config.hidden_size)
    down = layer.mlp.down_proj
    torch.testing.assert_close(
        down(torch.randn(0, config.intermediate_size)), torch.zeros(0, config.hidden_size))
    h = torch.randn(3, config.intermediate_size)
    torch.testing.assert_close(down(h), h @ _dequantized(hf_layer.mlp.down_proj.weight).T,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv(x), x @ (want_q.float() * want_scale[:, None]).T,
                               rtol=1e-5, atol=1e-5)
    assert FusedDecoder.supports(list(model.model.layers))
    kernel_weight = qkv.quant_method.kernel_weight(qkv)
    assert kernel_weight.qweight.data_ptr() == qkv.weight.data_ptr()
    assert kernel_weight.scale is qkv.weight_scale and not kernel_weight.quantize_activations
    qkv.weight_scale = qkv.weight_scale.double()
    with pytest.raises(ValueError, match="float32 scales"):
        qkv.quant_method.kernel_weight(qkv)


@pytest.mark.slow
def test_int8_tensor_parallel_equals_its_per_shard_fake_quant(tiny_llama, tmp_path):
    """TP=2 quantizes each rank's shard: column-parallel rows as at TP=1, row-parallel weights
    per half of the input columns (their scales differ from TP=1's, so the oracle does too)."""
    from tests.distributed.common import run

    oracle = _fake_quant_checkpoint(tiny_llama, tmp_path / "tp2_fake_quant", 2)
    params = [SamplingParams(max_tokens=8, temperature=0.0)]
    assert run(tiny_llama, params, quantization="int8", tensor_parallel_size=2,
               distributed_executor_backend="mp") == run(oracle, params)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_portable_torch_path_matches_the_native_kernels(tiny_llama, monkeypatch, quantization):
    """Without the native kernels (or off the CPU) the layers compute the same in torch."""
    import pagedllm.layers.quantization.int8 as int8_module

    config = AutoConfig.from_pretrained(tiny_llama)
    model = load_model(str(tiny_llama), config, torch.float32, torch.device("cpu"), quantization)
    layer = model.model.layers[0]
    x = torch.randn(5, config.hidden_size)
    h = torch.randn(2, 3, config.intermediate_size)
    native = layer.self_attn.qkv_proj(x), layer.mlp.down_proj(h)
    monkeypatch.setattr(int8_module, "cpu_kernels", lambda: None)
    portable = layer.self_attn.qkv_proj(x), layer.mlp.down_proj(h)
    for got, want in zip(portable, native):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _FakeQuantLinear(nn.Module):
    """An nn.Linear computed as W8A8 would be, in float64: per-channel int8 weight, per-token
    int8 activations, both dequantized before the product."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = _dequantized(linear.weight.detach()).double()
        self.bias = None if linear.bias is None else linear.bias.detach().double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_activations_per_token(x2)
        y = nn.functional.linear(xq.double() * xs.double()[:, None], self.weight, self.bias)
        return y.view(*x.shape[:-1], -1).to(x.dtype)


def _hf_fake_quant_prompt_logprobs(path, prompts) -> list[list[float]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, _FakeQuantLinear(module))
    result = []
    with torch.no_grad():
        for ids in prompts:
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            result.append([float(logprobs[i - 1, t]) for i, t in enumerate(ids) if i > 0])
    return result


def _engine_prompt_logprobs(path, quantization, prompts) -> list[list[float]]:
    llm = LLM(str(path), quantization=quantization, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]


def test_w8a8_prompt_logprobs_close_to_hf_fake_quant(tiny_llama):
    prompts = _prompts()[1:]
    got = _engine_prompt_logprobs(tiny_llama, "w8a8", prompts)
    want = _hf_fake_quant_prompt_logprobs(tiny_llama, prompts)
    plain = _engine_prompt_logprobs(tiny_llama, "none", prompts)
    flat = lambda rows: torch.tensor([v for r in rows for v in r])  # noqa: E731
    diff = (flat(got) - flat(want)).abs().max()
    assert diff < 1e-3 * max(1.0, float(flat(want).abs().max()))
    # The activations really were quantized: the float model is further away than that.
    assert (flat(plain) - flat(want)).abs().max() > 5 * diff


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_int8_refused_for_gguf_models(quantization):
    with pytest.raises(ValueError, match="gguf"):
        ModelConfig(model="/models/smol.Q4_0.gguf", quantization=quantization)

