"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py, found through
`PAGEDLLM_LLAMACPP_CONVERTER`; every test here skips when it is unset or not a file) from tiny
random HF checkpoints of the hybrid families: `qwen3next`, `qwen35` (Qwen3.5, its value heads
tiled), `mamba2`, `lfm2`, `granitehybrid` (Granite 4 hybrid), `falcon-h1`.

The converter runs as a subprocess with its own gguf-py (it puts it on its path). It names a
GPT-2-style vocabulary only by the hash of a known model's tokenization, so the checkpoints carry
a known one: StarCoder's, read from the vocabulary file the converter ships
(models/ggml-vocab-starcoder.gguf, 49152 tokens); the tests feed token ids.

Oracles: HF transformers' float32 greedy decoding of the same checkpoint (tokens equal,
chosen-token logprobs within 1e-3) for the F32 files; the safetensors checkpoint's parameters to
float16 precision for the F16 files; the dequantized load of the same file for the Q8_0 files'
layers kept in blocks; and our own writer
(tests/fixtures/gguf_converted.py) for the file
itself: the same metadata keys and the same tensors, byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams, envs
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_converted import spell_layer_types_as_the_hub, write_converted_gguf
# Qwen3.5 with 32-weight value heads, Granite 4.0-H and Falcon-H1 as released (see there).
from tests.model_loader.test_gguf_hybrids import (FALCON_H1, GRANITE_HYBRID, QWEN3_5_BLOCKS,
                                                  QWEN3_NEXT, assert_blocks_equal_the_dequantized_load,
                                                  assert_experts_in_blocks)
from tests.models.test_hybrid_models import MAX_TOKENS, MODELS, _hf_greedy, _prompts

CONVERTER = envs.get("PAGEDLLM_LLAMACPP_CONVERTER")
pytestmark = [
    pytest.mark.slow,   # each conversion starts the converter (torch, transformers): ~10 s
    pytest.mark.skipif(CONVERTER is None or not Path(CONVERTER).is_file(),
                       reason="PAGEDLLM_LLAMACPP_CONVERTER (llama.cpp's convert_hf_to_gguf.py) "
                              "is not set to a file"),
]

# Qwen3.5 as llama.cpp can run it: value heads as large as key heads (its loader sizes
# `attn_qkv` by the key head size), MRoPE sections within the 4 rotated dims (the converter
# writes the default [11, 11, 10] otherwise, past them, and llama.cpp aborts); value heads still
# tiled (4 to 2 key heads).
QWEN3_5_LLAMACPP = ("Qwen3_5ForCausalLM", {
    **MODELS["qwen3_5"][1], "linear_value_head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                        "mrope_interleaved": True}})
FAMILIES = {"qwen3_5_llamacpp": QWEN3_5_LLAMACPP, "qwen3_next": QWEN3_NEXT, "qwen3_5": MODELS["qwen3_5"],
            "qwen3_5_blocks": QWEN3_5_BLOCKS, "mamba2": MODELS["mamba2"],
            "lfm2": MODELS["lfm2"], "granite_hybrid": GRANITE_HYBRID, "falcon_h1": FALCON_H1}
# The HF model name `_hf_greedy` takes (eager experts for Qwen3-Next).
HF_NAMES = {"qwen3_5_blocks": "qwen3_5"}
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
# The blocks' kernels sum in another order than the dequantized float32 layers: on the
# ill-conditioned steps of random tiny models (the 70-token prompt) that moves a logprob by up
# to ~1.3e-4 (Qwen3-Next at Q8_0).
Q8_LOGPROB_TOL = 5e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("converter_views")))
    patch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")   # exact float activations
    yield
    patch.undo()


@pytest.fixture(scope="module")
def starcoder_tokenizer_dir(tmp_path_factory) -> Path:
    """StarCoder's tokenizer, from the vocabulary file beside the converter."""
    from transformers import AutoTokenizer

    vocab = Path(CONVERTER).parent / "models" / "ggml-vocab-starcoder.gguf"
    if not vocab.is_file():
        pytest.skip(f"{vocab} is missing")
    out = tmp_path_factory.mktemp("starcoder_tokenizer")
    AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=vocab.name).save_pretrained(out)
    return out


def run_converter(checkpoint: Path, out: Path, outtype: str) -> Path:
    """`out`, written by the converter from `checkpoint` (`--outtype` f32 / f16 / q8_0; for the
    Qwen families no MTP blocks: tiny checkpoints have none, and the converter asks for a
    count).

    Raises:
        RuntimeError: with the converter's output when it fails.
    """
    arch = json.loads((checkpoint / "config.json").read_text())["architectures"][0]
    extra = ["--no-mtp"] if arch.startswith("Qwen3") else []
    proc = subprocess.run([sys.executable, CONVERTER, str(checkpoint), "--outfile", str(out),
                           "--outtype", outtype, *extra], capture_output=True, text=True)
    if proc.returncode or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {checkpoint}:\n{proc.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory, starcoder_tokenizer_dir):
    """converted(family, outtype) -> (checkpoint folder, the converter's .gguf file)."""
    root = tmp_path_factory.mktemp("converted")
    made: dict = {}

    def get(family: str, outtype: str = "f32") -> tuple[Path, Path]:
        checkpoint = root / family
        if not checkpoint.is_dir():
            arch, config = FAMILIES[family]
            make_tiny_checkpoint(checkpoint, arch, starcoder_tokenizer_dir, **config)
            spell_layer_types_as_the_hub(checkpoint)
        if (family, outtype) not in made:
            made[family, outtype] = run_converter(checkpoint, root / f"{family}-{outtype}.gguf",
                                                  outtype)
        return checkpoint, made[family, outtype]

    return get


@pytest.fixture(scope="module")
def hf_greedy(converted):
    """family -> HF's float32 [(tokens, logprobs)] per prompt of `_prompts()`."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            checkpoint, _ = converted(family)
            cache[family] = _hf_greedy(checkpoint, HF_NAMES.get(family, family), torch.float32)
        return cache[family]

    return get


def _run(model, **kwargs) -> tuple[list[list[int]], list[list[float]], LLM]:
    llm = LLM(str(model), **{**ENGINE_ARGS, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
             for o in outs], llm)


def _fields(reader: gguf.GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith(("general.", "tokenizer.", "GGUF."))}


@pytest.mark.parametrize("family,outtype", [
    ("qwen3_next", "f32"), ("qwen3_next", "q8_0"), ("qwen3_5", "f32"), ("qwen3_5", "q8_0"),
    ("mamba2", "f32"), ("lfm2", "f32"), ("granite_hybrid", "f32"), ("granite_hybrid", "q8_0"),
    ("falcon_h1", "f32"), ("falcon_h1", "q8_0")])
def test_our_writer_writes_what_the_converter_writes(converted, tmp_path, family, outtype):
    checkpoint, theirs = converted(family, outtype)
    ours = write_converted_gguf(checkpoint, tmp_path / "ours.gguf", outtype.upper())
    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(str(ours))
    assert _fields(a) == _fields(b)
    tensors = {t.name: t for t in b.tensors}
    assert sorted(tensors) == sorted(t.name for t in a.tensors)
    for t in a.tensors:
        mine = tensors[t.name]
        assert (t.tensor_type, list(t.shape)) == (mine.tensor_type, list(mine.shape)), t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(mine.data)), t.name


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "mamba2", "lfm2", "granite_hybrid",
                                    "falcon_h1"])
def test_converted_f32_file_greedy_equals_hf(converted, hf_greedy, family):
    _, gguf_file = converted(family)
    tokens, logprobs, llm = _run(gguf_file, quantization="none")
    config = llm.llm_engine.engine_core.executor.worker.model_runner.model.config
    if family.startswith(("qwen", "lfm2")):
        assert list(config.layer_types) == FAMILIES[family][1]["layer_types"]
    elif family == "granite_hybrid":
        assert list(config.layers_block_type) == ["linear_attention", "full_attention",
                                                  "linear_attention"]
    want = hf_greedy(family)
    assert tokens == [t for t, _ in want]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor([lp for _, lp in want]),
                               atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_converted_f16_file_loads_the_checkpoint_rounded_to_f16(converted, family):
    """An F16 file: every parameter the engine loads equals the safetensors checkpoint's to
    float16's precision (greedy tokens of random tiny models flip under that rounding)."""
    checkpoint, gguf_file = converted(family, "f16")

    def params(model_path, **kwargs):
        llm = LLM(str(model_path), **{**ENGINE_ARGS, **kwargs})
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    want, got = params(checkpoint), params(gguf_file, quantization="none")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=2 ** -10, atol=1e-7, msg=name)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_blocks"])
def test_converted_q8_0_file_stays_in_blocks_and_equals_the_dequantized_load(converted, family):
    _, gguf_file = converted(family, "q8_0")

    def check_blocks(model):
        delta_net = model.model.layers[0].linear_attn
        assert {delta_net.in_proj_qkv.gguf_quant_type, delta_net.in_proj_z.gguf_quant_type,
                delta_net.out_proj.gguf_quant_type} == {"Q8_0"}

    assert_blocks_equal_the_dequantized_load(_run, gguf_file, check_blocks, Q8_LOGPROB_TOL)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_converted_granite_q8_0_file_keeps_layers_and_experts_in_blocks(converted):
    """Granite 4 hybrid at Q8_0: the Mamba and attention projections (attn_q / attn_k rows
    un-permuted on the blocks), the shared MLP's two halves and the experts stay in blocks and
    equal the dequantized load."""
    _, gguf_file = converted("granite_hybrid", "q8_0")

    def check_blocks(model):
        layers = model.model.layers
        assert {layers[0].mamba.in_proj.gguf_quant_type,
                layers[1].self_attn.q_proj.gguf_quant_type,
                layers[1].self_attn.k_proj.gguf_quant_type,
                layers[1].shared_mlp.input_linear.gguf_quant_type} == {"Q8_0"}
        assert_experts_in_blocks(model)

    assert_blocks_equal_the_dequantized_load(_run, gguf_file, check_blocks, Q8_LOGPROB_TOL)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_converted_falcon_h1_q8_0_file_stays_in_blocks_and_equals_the_dequantized_load(converted):
    """Falcon-H1 at Q8_0 (its multipliers folded into the blocks by the converter): the Mamba,
    attention and MLP projections stay in blocks and equal the dequantized load."""
    _, gguf_file = converted("falcon_h1", "q8_0")

    def check_blocks(model):
        layer = model.model.layers[0]
        assert {layer.mamba.in_proj.gguf_quant_type, layer.self_attn.k_proj.gguf_quant_type,
                layer.feed_forward.gate_proj.gguf_quant_type} == {"Q8_0"}

    assert_blocks_equal_the_dequantized_load(_run, gguf_file, check_blocks, Q8_LOGPROB_TOL)


def _llamacpp_greedy(gguf_file: Path, prompts: list[list[int]]) -> list[list[int]]:
    """llama.cpp's greedy tokens (argmax of its float32 logits, `MAX_TOKENS` per prompt) on
    `gguf_file`, each prompt from an empty cache."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_file), n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2,
                          logits_all=True, verbose=False)
    out = []
    try:
        for prompt in prompts:
            llm.reset()
            llm.eval(prompt)
            tokens = []
            for _ in range(MAX_TOKENS):
                tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval(tokens[-1:])
            out.append(tokens)
    finally:
        llm.close()
    return out


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_llamacpp", "mamba2", "lfm2",
                                    "granite_hybrid", "falcon_h1"])
def test_llamacpp_greedy_tokens_equal_ours(converted, family):
    """llama-cpp-python (`PAGEDLLM_LLAMACPP_SITE_PACKAGES`) on the very same F32 file: the same
    greedy tokens as the engine's."""
    from pagedllm.benchmarks.llamacpp_baseline import llamacpp_unavailable_reason

    reason = llamacpp_unavailable_reason()
    if reason is not None:
        pytest.skip(reason.splitlines()[0])
    _, gguf_file = converted(family)
    tokens, _, _ = _run(gguf_file, quantization="none")
    assert _llamacpp_greedy(gguf_file, _prompts()) == tokens
