"""GGUF linear weights kept in their blocks (`quantization="gguf"`, layers/quantization/gguf.py)
against the same file dequantized at load (`quantization="none"`, the oracle): greedy tokens on
tiny Llama files (one type, and a Q4_K_M-like mix of K-quants inside fused layers), the fused
CPU decoder on those blocks against the module path, the token embedding / tied LM head kept
quantized, the layers' storage, the automatic choice and its fallback, the raw slices (row maps,
tensor-parallel column slices on block boundaries) and the errors. These exactness checks run
with float32 activations (`PAGEDLLM_GGUF_Q8_ACTIVATIONS=0`); the default 8-bit activations
(csrc/gguf_q8_dot.h) are checked fused against the module path (greedy equal) and against float
activations (prompt logprobs close, top-1 agreeing)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.native.kernels import cpu_kernels
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.gguf import (Q8_ACTIVATIONS_ENV, ROW_GROUPS_ENV,
                                               GGUFLayoutUnsupported, GGUFLinearMethod)
from pagedllm.model_loader.gguf import (GGUFSource, dequantize, iterate_gguf_tensors, open_gguf,
                                        prepare_gguf_view, tensor_table)
from pagedllm.model_loader.loader import load_model
from pagedllm.native.fused_decoder import FusedDecoder
from pagedllm.models.llama import unpermute_rope_rows
from pagedllm.platforms import current_platform
from pagedllm.layers.quantization.gguf import GGUFEmbeddingMethod
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_files import quantize, write_gguf, write_raw_gguf

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


# A Q4_K_M-like mix, as llama.cpp's quantizer writes it: Q4_K, with attn_v and ffn_down in Q6_K
# and the (tied) token embedding in Q6_K; here also a Q5_K gate next to a Q4_K up projection.
Q4_K_M_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "ffn_gate": "Q5_K", "token_embd": "Q6_K"}


@pytest.fixture(scope="module")
def kquant_gguf(byte_level_tokenizer_dir, tmp_path_factory):
    """A tiny tied-embedding Llama whose sizes fit 256-weight K-quant blocks, as Q4_K_M."""
    root = tmp_path_factory.mktemp("gguf_kquant")
    checkpoint = make_tiny_checkpoint(root / "llama256", "LlamaForCausalLM",
                                      byte_level_tokenizer_dir, hidden_size=256,
                                      intermediate_size=512, tie_word_embeddings=True)
    return write_gguf(checkpoint, root / "llama-q4_k_m.gguf", "Q4_K",
                      tensor_types=Q4_K_M_TYPES)


def _greedy(path, quantization: str | None, fused: bool = True, q8: bool = False,
            logprobs: bool = False) -> list:
    """Greedy token ids of four prompts; with `logprobs`, (ids, each step's top-2 logprobs)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_CPU_FUSED_DECODER", "1" if fused else "0")
    patch.setenv(Q8_ACTIVATIONS_ENV, "1" if q8 else "0")
    try:
        llm = LLM(str(path), quantization=quantization, **ENGINE_ARGS)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                logprobs=2 if logprobs else None)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        patch.undo()
    if logprobs:
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs]


def _load(path, quantization: str | None, q8: bool | None = False):
    """The model of a .gguf file; q8: its GGUF layers' 8-bit activations (None: the default,
    the environment switch unset)."""
    view = prepare_gguf_view(str(path))
    patch = pytest.MonkeyPatch()
    if q8 is None:
        patch.delenv(Q8_ACTIVATIONS_ENV, raising=False)
    else:
        patch.setenv(Q8_ACTIVATIONS_ENV, "1" if q8 else "0")
    try:
        current_platform.configure_options()     # load_model is called without an engine
        return load_model(view, AutoConfig.from_pretrained(view), torch.float32,
                          torch.device("cpu"), quantization)
    finally:
        patch.undo()


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_greedy_equals_the_dequantized_load_and_the_module_path(llama_gguf, tensor_type):
    path = llama_gguf(tensor_type)
    fused = _greedy(path, "gguf")
    assert fused == _greedy(path, "none")
    assert fused == _greedy(path, "gguf", fused=False)
    with pytest.MonkeyPatch.context() as patch:    # the file's plain rows, not row groups
        patch.setenv(ROW_GROUPS_ENV, "0")
        assert fused == _greedy(path, "gguf")


def test_q4_k_m_mix_stays_quantized_and_matches(kquant_gguf):
    model = _load(kquant_gguf, None)                 # the default for a .gguf file
    layer = model.model.layers[0]
    qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
    assert qkv.gguf_quant_type is None and qkv.weight.dim() == 1
    assert [(s.rows, s.tensor_type) for s in qkv.gguf_segments] == [
        (256, "Q4_K"), (128, "Q4_K"), (128, "Q6_K")]
    assert qkv.weight.numel() == 384 * 144 + 128 * 210           # no padding between segments
    assert [s.tensor_type for s in gate_up.gguf_segments] == ["Q5_K", "Q4_K"]
    assert down.gguf_quant_type == "Q6_K" and down.weight.shape == (256, 2 * 210)
    embed = model.model.embed_tokens
    assert isinstance(embed.quant_method, GGUFEmbeddingMethod)
    assert embed.quant_method.tensor_type == "Q6_K" and embed.weight.dtype == torch.uint8
    assert model.lm_head.weight is embed.weight and model.lm_head.quant_method is embed.quant_method
    assert FusedDecoder.supports(list(model.model.layers))
    plain = _load(kquant_gguf, "none")
    x = torch.randn(3, 256)
    for got, want in ((qkv, plain.model.layers[0].self_attn.qkv_proj),
                      (gate_up, plain.model.layers[0].mlp.gate_up_proj)):
        torch.testing.assert_close(got(x), want(x), rtol=1e-4, atol=1e-4)
    ids = torch.tensor([0, 7, 200, 7])
    torch.testing.assert_close(embed(ids), plain.model.embed_tokens(ids), rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.compute_logits(x),
                               plain.lm_head.compute_logits(x), rtol=1e-4, atol=1e-4)
    fused = _greedy(kquant_gguf, "gguf")
    assert fused == _greedy(kquant_gguf, "none")
    assert fused == _greedy(kquant_gguf, "gguf", fused=False)


def test_linear_layers_keep_their_blocks_and_take_the_fused_decoder(llama_gguf):
    model = _load(llama_gguf("Q4_0"), None)          # the default for a .gguf file
    layer = model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.gguf_quant_type == "Q4_0"
    assert qkv.gguf_grouped and model.model.embed_tokens.quant_method.grouped
    assert qkv.weight.shape == (qkv.output_size_per_partition, 64 // 32 * 18)
    assert down.weight.shape == (64, 128 // 32 * 18)
    assert model.model.embed_tokens.weight.dtype == torch.uint8     # token_embd is Q4_0 too
    assert FusedDecoder.supports(list(model.model.layers))
    plain = _load(llama_gguf("Q4_0"), "none")
    assert plain.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    x = torch.randn(3, 64)
    torch.testing.assert_close(qkv(x), plain.model.layers[0].self_attn.qkv_proj(x),
                               rtol=1e-5, atol=1e-5)


def test_types_without_a_kernel_fall_back_or_are_named(llama_gguf, tiny_checkpoints, tmp_path):
    path = llama_gguf("BF16")
    model = _load(path, None)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    with pytest.raises(GGUFLayoutUnsupported, match="BF16"):
        _load(path, "gguf")
    # A token embedding without a kernel is dequantized alone; the linears keep their blocks.
    mixed = write_gguf(tiny_checkpoints["llama"], tmp_path / "embd-bf16.gguf", "Q8_0",
                       tensor_types={"token_embd": "BF16"})
    model = _load(mixed, "gguf")
    embed = model.model.embed_tokens
    assert embed.weight.dtype == torch.float32 and embed.quant_method.tensor_type is None
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    ids = torch.tensor([1, 5, 9])
    torch.testing.assert_close(embed(ids), _load(mixed, "none").model.embed_tokens(ids))


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


def test_fused_layer_of_mixed_types_and_unaligned_shards(raw_file):
    layer = MergedColumnParallelLinear(64, [8, 8])
    layer.set_quant_method(GGUFLinearMethod(quantize_activations=False))
    layer.weight_loader(layer.weight, raw_file["b.weight"], 1)     # out of order: Q4_0 rows 8..16
    with pytest.raises(ValueError, match="do not cover"):
        layer(torch.randn(1, 64))
    layer.weight_loader(layer.weight, raw_file["a.weight"], 0)     # Q8_0 rows 0..8
    assert layer.gguf_quant_type is None
    assert [(s.row_start, s.tensor_type) for s in layer.gguf_segments] == [(0, "Q8_0"),
                                                                          (8, "Q4_0")]
    w = torch.cat([raw_file[n].materialize() for n in ("a.weight", "b.weight")])
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block boundaries"):
        RowParallelLinear(48, 8).set_quant_method(GGUFLinearMethod(quantize_activations=False))


def test_row_groups_after_loading_and_reloads(raw_file):
    """`process_weights_after_loading` puts each segment's bytes in the kernels' row-group
    layout (outputs unchanged); reloading a tensor afterwards goes back to plain rows first,
    and the next processing groups again."""
    layer = MergedColumnParallelLinear(64, [8, 8])
    layer.set_quant_method(GGUFLinearMethod(quantize_activations=False))
    layer.weight_loader(layer.weight, raw_file["a.weight"], 0)
    layer.weight_loader(layer.weight, raw_file["b.weight"], 1)
    plain_bytes = layer.weight.data.clone()
    w = torch.cat([raw_file[n].materialize() for n in ("a.weight", "b.weight")])
    x = torch.randn(3, 64)
    layer.quant_method.process_weights_after_loading(layer)
    layer.quant_method.process_weights_after_loading(layer)          # idempotent
    assert layer.gguf_grouped and not torch.equal(layer.weight.data, plain_bytes)
    assert all(s[3] for s in layer.quant_method.kernel_segments(layer))
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
    layer.weight_loader(layer.weight, raw_file["b.weight"], 1)       # a reload
    assert not layer.gguf_grouped and torch.equal(layer.weight.data, plain_bytes)
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.gguf_grouped
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)


def test_k_quant_rows_must_fit_the_input_size(raw_file, tmp_path):
    data = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    path = write_raw_gguf(tmp_path / "k.gguf", "llama", {"k.weight": (quantize(data, "Q4_K"),
                                                                      "Q4_K")})
    stat = os.stat(path)
    source = GGUFSource(str(path), "llama", stat.st_size, stat.st_mtime_ns,
                        tensor_table(open_gguf(path)))
    tensor = dict(iterate_gguf_tensors(source, torch.float32))["k.weight"]
    layer = RowParallelLinear(256, 4)
    layer.set_quant_method(GGUFLinearMethod(quantize_activations=False))
    layer.weight_loader(layer.weight, tensor)
    x = torch.randn(2, 256)
    torch.testing.assert_close(layer(x), x @ tensor.materialize().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block boundaries"):
        tensor.narrow(1, 0, 128).materialize_raw()


# --------------------------------------------------------------------------- 8-bit activations


def _prompt_logprobs(path, q8: bool) -> tuple[list[int], list[float], list[int]]:
    """(prompt ids, logprob of each prompt token after the first, the top-1 id there) of one
    64-token prompt, module-path engine."""
    prompt = torch.randint(3, 200, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    patch = pytest.MonkeyPatch()
    patch.setenv(Q8_ACTIVATIONS_ENV, "1" if q8 else "0")
    try:
        llm = LLM(str(path), quantization="gguf", **ENGINE_ARGS)
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    finally:
        patch.undo()
    entries = out.prompt_logprobs[1:]
    logprobs = [e[t].logprob for e, t in zip(entries, prompt[1:])]
    top1 = [max(e.items(), key=lambda kv: kv[1].logprob)[0] for e in entries]
    return prompt, logprobs, top1


@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q8_0"])
def test_q8_activations_fused_equals_the_module_path(llama_gguf, tensor_type):
    """Both paths round the same activations with the same kernels (the fused one inside its
    parallel region, on a shared scratch). NOTE(q8): their float32 inputs differ in the last
    bits (the fused layer's own norms and attention), so a value on a rounding boundary may
    move by one quant (0.01 nats here, where float32 paths agree to 1e-5: the bound 0.05
    still catches a wrong scale or row); the tiny Q4_K_M model below amplifies such a flip to ~1 logit (its
    module path alone moves 0.15 between 8-bit and float activations), so it is no oracle
    for this comparison; the K-quants' integer kernels are checked in test_gguf_kernels.py."""
    path = llama_gguf(tensor_type)
    model = _load(path, "gguf", q8=True)
    assert model.model.layers[0].mlp.down_proj.quant_method.quantize_activations
    assert FusedDecoder.supports(list(model.model.layers))
    fused = _greedy(path, "gguf", q8=True, logprobs=True)
    module = _greedy(path, "gguf", fused=False, q8=True, logprobs=True)
    assert [ids for ids, _ in fused] == [ids for ids, _ in module]
    for (ids, lps_f), (_, lps_m) in zip(fused, module):
        for token, lp_f, lp_m in zip(ids, lps_f, lps_m):
            assert abs(lp_f[token].logprob - lp_m[token].logprob) < 0.05


def test_q8_activations_are_the_default_and_stay_close(llama_gguf, kquant_gguf):
    """On by default for GGUF layers and the quantized LM head, off with the switch at 0;
    against float activations on the tiny Q4_1 Llama (token embedding and LM head in Q4_1 too): teacher-forced logprobs
    within 0.3 nats at the median position and top-1 tokens agreeing at >= 80% of positions.
    NOTE(q8): loose on purpose: this random model's logits span ~25 and its 64-wide rows are
    two blocks each, so a rounding of ~1% of a block's largest value moves single logprobs by
    up to ~1.5 nats; wrong scales or rows would leave nothing in common. The quality measure
    is SmolLM2's perplexity (docs/benchmarks.md)."""
    default = _load(kquant_gguf, None, q8=None)
    methods = [m.quant_method for m in default.modules() if hasattr(m, "quant_method")]
    assert methods and all(m.quantize_activations for m in methods)
    off = _load(kquant_gguf, None, q8=False)
    methods = [m.quant_method for m in off.modules() if hasattr(m, "quant_method")]
    assert not any(m.quantize_activations for m in methods)
    path = llama_gguf("Q4_1")
    _, lp_on, top_on = _prompt_logprobs(path, q8=True)
    _, lp_off, top_off = _prompt_logprobs(path, q8=False)
    diffs = sorted(abs(a - b) for a, b in zip(lp_on, lp_off))
    assert 0 < diffs[len(diffs) // 2] < 0.3, diffs
    assert sum(a == b for a, b in zip(top_on, top_off)) >= 0.8 * len(top_on)


@pytest.mark.parametrize("variable", [ROW_GROUPS_ENV, Q8_ACTIVATIONS_ENV])
def test_a_switch_typo_fails_before_any_weight_loads(llama_gguf, variable):
    """Both switches are read with every PAGEDLLM_* variable when an engine starts
    (`current_platform.configure_options`, before the model is built), so a typo is refused
    before the weights load rather than after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(variable, "maybe")
        with pytest.raises(ValueError, match=variable):
            LLM(str(llama_gguf("Q8_0")), quantization="gguf", **ENGINE_ARGS)
