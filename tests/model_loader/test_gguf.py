"""GGUF files as checkpoints (model_loader/gguf.py): end to end against transformers reading the
same file (the oracle) and against the original safetensors checkpoint, the tokenizer and chat
template from the file's metadata, dequantization of every supported tensor type against
independent references, the view cache, and clear errors for what is not supported.

Tiny files are written as llama.cpp's converter writes them (tests/fixtures/gguf_files.py).
Checkpoint views go under pytest's temp dir ($PAGEDLLM_GGUF_CACHE), never ~/.cache. The
real-weights check (SmolLM2, `slow`) is in test_gguf_smollm2.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.hf_config import hf_model_info
from pagedllm.entrypoints.cli import build_parser, main as cli_main
from pagedllm.entrypoints.openai.cli_args import check_serve_args
from pagedllm.model_loader.gguf import (SUPPORTED_TENSOR_TYPES, GGUFSource, GGUFTensor,
                                        GGUFTensorInfo, _generation_config,
                                        iterate_gguf_tensors, open_gguf, prepare_gguf_view,
                                        prune_stale_views, read_gguf_source, tensor_table)
from pagedllm.models.llama import LlamaForCausalLM, unpermute_rope_rows
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_files import (llama_cpp_permute, llama_cpp_rope_factors, write_gguf,
                                      write_raw_gguf)

MAX_TOKENS = 10
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXTS = ["Hello world", "The old man reads a long letter.", "  two  spaces\nand a line",
         "café naïve 日本語 🙂 🚀", "12345 + 678 = ?"]


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("gguf_views")))
    # Exact float32 activations: transformers (the oracle) computes on the dequantized weights.
    patch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")
    yield
    patch.undo()


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, byte_level_tokenizer_dir, tmp_path_factory):
    """Variant -> (HF checkpoint folder, llama.cpp architecture); all with the byte-level
    tokenizer. "llama": GQA 4/2 heads, untied; "llama_tied_mqa": one KV head, tied embeddings;
    "qwen2": q/k/v biases, tied; "qwen3": q/k norms, head_dim 32 != hidden / heads."""
    tied = make_tiny_checkpoint(tmp_path_factory.mktemp("llama_tied_mqa"), "LlamaForCausalLM",
                                byte_level_tokenizer_dir, num_key_value_heads=1,
                                tie_word_embeddings=True, seed=1)
    return {"llama": (tiny_checkpoints["llama"], "llama"), "llama_tied_mqa": (tied, "llama"),
            "qwen2": (tiny_checkpoints["qwen2"], "qwen2"),
            "qwen3": (tiny_checkpoints["qwen3"], "qwen3")}


@pytest.fixture(scope="module")
def gguf_file(checkpoints, tmp_path_factory):
    """gguf_file(variant, tensor_type) -> path of the converted file, written once."""
    root = tmp_path_factory.mktemp("gguf_files")
    files: dict[tuple[str, str], Path] = {}

    def get(variant: str, tensor_type: str) -> Path:
        if (variant, tensor_type) not in files:
            folder, arch = checkpoints[variant]
            files[variant, tensor_type] = write_gguf(
                folder, root / f"{variant}-{tensor_type}.gguf", tensor_type, arch)
        return files[variant, tensor_type]

    return get


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (1, 3, 8, 17, 33, 70)]


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_from_gguf(path: Path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32)


# transformers reads qwen3 files with head_dim 128 whatever the file says (it ignores
# attention.key_length), so its oracle is the original checkpoint (test below).
@pytest.mark.parametrize("variant, tensor_type", [
    ("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
    ("llama_tied_mqa", "Q8_0"), ("qwen2", "Q5_1"),
])
def test_greedy_matches_transformers_on_the_same_file(gguf_file, variant, tensor_type):
    path = gguf_file(variant, tensor_type)
    hf = _hf_from_gguf(path)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(str(path), **ENGINE_ARGS)
    assert _engine_greedy(llm, prompts) == [_hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("variant", ["llama", "llama_tied_mqa", "qwen2", "qwen3"])
def test_f32_file_matches_the_original_checkpoint(checkpoints, gguf_file, variant):
    """Names, Q/K row order and head_dim recovered without transformers' GGUF reader."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[variant][0], dtype=torch.float32)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(str(gguf_file(variant, "F32")), **ENGINE_ARGS)
    assert _engine_greedy(llm, prompts) == [_hf_greedy(hf, p) for p in prompts]


def test_tokenizer_chat_template_and_eos_come_from_metadata(checkpoints, gguf_file):
    path = gguf_file("llama", "Q8_0")
    original = AutoTokenizer.from_pretrained(checkpoints["llama"][0])
    oracle = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    llm = LLM(str(path), **ENGINE_ARGS)
    ours = llm.get_tokenizer()
    for text in TEXTS:
        assert ours(text).input_ids == oracle(text).input_ids == original(text).input_ids
        assert ours.decode(ours(text).input_ids, skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == original.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
    eos = original.eos_token_id
    assert llm.llm_engine.input_processor.eos_token_ids == (eos,)
    assert hf_model_info(llm.llm_engine.config.model_path).bos_token_id == original.bos_token_id
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == original.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert len(out.outputs[0].token_ids) >= 1



def test_tokenizer_files_next_to_the_gguf_file_do_not_win(checkpoints, gguf_file, tmp_path):
    """A .gguf file kept in a folder with another checkpoint's tokenizer files (no chat template,
    no eos): the view still takes the tokenizer, chat template and eos from the file."""
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_file("llama", "Q8_0").read_bytes())
    decoy = AutoTokenizer.from_pretrained(checkpoints["llama"][0])
    decoy.chat_template = None
    decoy.eos_token = None
    decoy.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    view = prepare_gguf_view(str(path))
    ours = AutoTokenizer.from_pretrained(view)
    original = AutoTokenizer.from_pretrained(checkpoints["llama"][0])
    assert ours.chat_template == original.chat_template is not None
    assert ours.eos_token_id == original.eos_token_id is not None
    assert json.loads((Path(view) / "config.json").read_text())["model_type"] == "llama"

def test_end_of_generation_ids_and_sampling_defaults_reach_generation_config(checkpoints,
                                                                             tmp_path):
    """Chat models end turns with an eot token besides eos (Llama 3's <|eot_id|>): both stop."""
    path = write_gguf(checkpoints["llama"][0], tmp_path / "eot.gguf", "F32", extra_metadata={
        "tokenizer.ggml.eot_token_id": 2, "general.sampling.temp": 0.5,
        "general.sampling.top_k": 40})
    view = prepare_gguf_view(str(path))
    eos = AutoTokenizer.from_pretrained(checkpoints["llama"][0]).eos_token_id
    assert hf_model_info(view).eos_token_ids == (eos, 2)
    gen = json.loads((Path(view) / "generation_config.json").read_text())
    assert gen["temperature"] == 0.5 and gen["top_k"] == 40


def test_sampling_defaults_of_the_file_are_the_default_sampling_params(checkpoints, tmp_path):
    """llama.cpp's recommended sampling (general.sampling.*) is what a request that leaves the
    fields out gets: top_k 1 makes the default generate greedy; generation_config="vllm" drops
    it."""
    path = write_gguf(checkpoints["llama"][0], tmp_path / "top_k1.gguf", "F32", extra_metadata={
        "general.sampling.top_k": 1, "general.sampling.temp": 0.75,
        "general.sampling.top_p": 0.5, "general.sampling.min_p": 0.25,
        "general.sampling.penalty_repeat": 1.25})
    llm = LLM(str(path), **ENGINE_ARGS)
    assert llm.llm_engine.config.default_sampling_params == {
        "temperature": 0.75, "top_p": 0.5, "top_k": 1, "min_p": 0.25, "repetition_penalty": 1.25}
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.max_tokens) == (1, 16)
    prompts = [{"prompt_token_ids": p} for p in _prompts(hf_model_info(
        llm.llm_engine.config.model_path).vocab_size)] * 2
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.25)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert LLM(str(path), generation_config="vllm", **ENGINE_ARGS
               ).get_default_sampling_params().top_k == 0


def test_gemma2_file_matches_the_original_checkpoint(tiny_checkpoints, tmp_path):
    """Gemma 2 files: the soft-caps come from the file's metadata (transformers' reader drops
    them) and the query scale follows llama.cpp's rule; the fixture caps attention at 4 and the
    final logits at 8, so a missing cap changes the tokens."""
    folder = tiny_checkpoints["gemma2"]
    path = write_gguf(folder, tmp_path / "gemma2.gguf", "F32", "gemma2",
                      extra_metadata={"tokenizer.ggml.unknown_token_id": 0})
    view = json.loads((Path(prepare_gguf_view(str(path))) / "config.json").read_text())
    assert (view["attn_logit_softcapping"], view["final_logit_softcapping"]) == (4.0, 8.0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(str(path), **ENGINE_ARGS)
    assert _engine_greedy(llm, prompts) == [_hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("variant", ["phi3", "phi3_longrope_partial"])
def test_phi3_file_matches_the_original_checkpoint(tiny_checkpoints, tmp_path, variant):
    """Phi-3 files keep the fused qkv / gate_up tensors; LongRoPE comes back from the factor
    tensors and the original context length (prompts up to 70 tokens run past its 32), partial
    RoPE from rope.dimension_count."""
    folder = tiny_checkpoints[variant]
    path = write_gguf(folder, tmp_path / f"{variant}.gguf", "F32", "phi3")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(str(path), **ENGINE_ARGS)
    assert _engine_greedy(llm, prompts) == [_hf_greedy(hf, p) for p in prompts]


def test_end_of_turn_tokens_found_by_their_text(tmp_path):
    """Gemma's files state only <eos>; <end_of_turn> ends a chat turn too (llama.cpp finds such
    tokens by their text)."""
    tokens = ["<pad>", "<eos>", "<bos>", "hello", "<end_of_turn>", "<start_of_turn>"]
    path = write_raw_gguf(tmp_path / "vocab.gguf", "gemma3",
                          {"token_embd.weight": (np.zeros((6, 8), np.float32), "F32")},
                          {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 1})
    assert _generation_config(open_gguf(path))["eos_token_id"] == [1, 4]


def test_stale_views_are_pruned(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for path in (first, second):
        path.write_bytes(gguf_file("llama", "Q8_0").read_bytes())
    old = prepare_gguf_view(str(first))
    first.unlink()                                       # its view can never be used again
    kept = prepare_gguf_view(str(second))
    assert not Path(old).exists() and Path(kept).is_dir()
    assert prune_stale_views() == []


@pytest.mark.slow   # worker processes; tp=2 is checked by default on safetensors
def test_tensor_parallel_gguf_matches_tp1(gguf_file):
    from tests.distributed.common import run

    path = gguf_file("llama", "Q4_1")
    params = [SamplingParams(max_tokens=8, temperature=0.0)]
    assert run(path, params, tensor_parallel_size=2,
               distributed_executor_backend="mp") == run(path, params)


def test_cli_generate_and_serve_args_take_a_gguf_file(gguf_file, capsys):
    path = str(gguf_file("llama", "Q8_0"))
    code = cli_main(["generate", "--model", path, "--prompt", "The cat", "--max-tokens", "3",
                     "--temperature", "0", "--dtype", "float32", "--kv-cache-memory",
                     str(8 << 20)])
    assert code == 0
    assert "generated tokens: 3" in capsys.readouterr().out
    check_serve_args(build_parser().parse_args(["serve", "--model", path, "--port", "0"]))
    missing = build_parser().parse_args(["serve", "--model", path + ".missing.gguf"])
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        check_serve_args(missing)


def test_view_is_cached_and_rebuilt_when_the_file_changes(gguf_file, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_file("llama", "Q8_0").read_bytes())
    view = prepare_gguf_view(str(path))
    stamp = os.stat(Path(view) / "gguf.json").st_mtime_ns
    assert prepare_gguf_view(str(path)) == view
    assert os.stat(Path(view) / "gguf.json").st_mtime_ns == stamp
    assert read_gguf_source(view).path == str(path.resolve())
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="changed since"):
        read_gguf_source(view)
    assert prepare_gguf_view(str(path)) != view


# --------------------------------------------------------------------------- errors

def test_unsupported_architecture_is_named(tmp_path):
    path = write_raw_gguf(tmp_path / "mamba.gguf", "mamba",
                          {"token_embd.weight": (np.zeros((4, 32), np.float32), "F32")})
    with pytest.raises(ValueError, match=r"GGUF architecture 'mamba' of .*mamba.gguf is not "
                                         r"supported; supported: \[.*'llama'"):
        LLM(str(path), **ENGINE_ARGS)


def test_unsupported_tensor_type_is_named(tmp_path):
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ1_M][1]
    path = write_raw_gguf(tmp_path / "iq1_m.gguf", "llama",
                          {"blk.0.attn_q.weight": (np.zeros((4, block), np.uint8), "IQ1_M")})
    with pytest.raises(ValueError, match="GGUF tensor type IQ1_M \\(tensor blk.0.attn_q.weight"):
        LLM(str(path), **ENGINE_ARGS)
    # The loader checks again (a view built by another version, or a hand-made source).
    info = GGUFTensorInfo("blk.0.attn_q.weight", "IQ1_M", (4, 256), 0, 4 * block)
    source = GGUFSource(str(path), "llama", 0, 0, (info,))
    with pytest.raises(ValueError, match="IQ1_M"):
        next(iterate_gguf_tensors(source, torch.float32))


def test_tensor_without_a_parameter_is_named(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"][0], tmp_path / "extra.gguf", "F32",
                      extra_tensors={"blk.0.attn_sinks.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="GGUF tensor blk.0.attn_sinks.weight has no counterpart "
                                         "in LlamaForCausalLM"):
        LLM(str(path), **ENGINE_ARGS)


def _file_tensors(path: Path) -> list[tuple[str, GGUFTensor]]:
    reader = open_gguf(path)
    buffer = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    return [(info.name, GGUFTensor(buffer, info, torch.float32)) for info in tensor_table(reader)]


def test_llama3_rope_freqs_become_the_config_scaling(tiny_checkpoints, tmp_path):
    """llama.cpp stores Llama 3.1+ RoPE scaling as `rope_freqs.weight` (factors it divides the
    frequencies by); the view turns them back into llama3 parameters, and the loader refuses
    factors that no llama3 setting gives, naming the mismatch."""
    folder = tiny_checkpoints["llama_mqa_tied_llama3"]
    config = AutoConfig.from_pretrained(folder)
    rope = config.rope_parameters
    head_size = config.hidden_size // config.num_attention_heads
    factors = llama_cpp_rope_factors(rope, head_size).numpy()
    path = write_gguf(folder, tmp_path / "llama3.gguf", "F32",
                      extra_tensors={"rope_freqs.weight": factors})
    names = [name for name, _ in
             LlamaForCausalLM.gguf_checkpoint_weights(config, _file_tensors(path))]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("rope" in name for name in names)
    # transformers' GGUF reader drops llama3 scaling from the config; the view puts back the
    # llama3 parameters that reproduce the factors, so the file runs like the original checkpoint.
    view = json.loads((Path(prepare_gguf_view(str(path))) / "config.json").read_text())
    assert view["rope_parameters"]["rope_type"] == "llama3"
    prompts = _prompts(config.vocab_size)[:3] + [list(range(3, 300))]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert _engine_greedy(LLM(str(path), **ENGINE_ARGS), prompts) == [_hf_greedy(hf, p)
                                                                     for p in prompts]
    # Factors no llama3 setting gives: the view keeps default RoPE and the loader refuses.
    wrong = factors.copy()
    wrong[-1] *= 2
    bad = write_gguf(folder, tmp_path / "llama3_bad.gguf", "F32",
                     extra_tensors={"rope_freqs.weight": wrong})
    with pytest.raises(ValueError, match=r"rope_freqs.weight does not match the config's RoPE "
                                         r"scaling \(rope_type 'default'\)"):
        LLM(str(bad), **ENGINE_ARGS)
    with pytest.raises(ValueError, match=f"factor {len(wrong) - 1} is"):
        list(LlamaForCausalLM.gguf_checkpoint_weights(config, _file_tensors(bad)))


def test_unit_rope_freqs_load_with_default_rope(checkpoints, gguf_file, tmp_path):
    folder = checkpoints["llama"][0]
    path = write_gguf(folder, tmp_path / "ones.gguf", "F32",
                      extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    prompts = _prompts(AutoConfig.from_pretrained(folder).vocab_size)[:3]
    want = _engine_greedy(LLM(str(gguf_file("llama", "F32")), **ENGINE_ARGS), prompts)
    assert _engine_greedy(LLM(str(path), **ENGINE_ARGS), prompts) == want


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        LLM(str(tmp_path / "absent.gguf"), **ENGINE_ARGS)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file")
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        LLM(str(bad), **ENGINE_ARGS)


# --------------------------------------------------------------------------- dequantization

def _finite_random_blocks(rng: np.random.Generator, rows: int, tensor_type: str,
                          cols: int) -> np.ndarray:
    """Random block bytes [rows, row_bytes] in which every aligned fp16 (the block scales) is
    finite: no byte has the all-ones fp16 exponent pattern."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]]
    raw = rng.integers(0, 256, (rows, cols // block * block_bytes), dtype=np.uint8)
    raw[(raw & 0x7C) == 0x7C] &= 0xFB
    return raw


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of the little-endian uint32 qh, as the 5th bit (16) of element j (0..31)."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")
    return bits.astype(np.float32) * 16


def _reference_legacy(raw: np.ndarray, tensor_type: str) -> np.ndarray:
    """ggml's dequantize_row_* for the 32-element block types, written from the format spec."""
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]][1]
    blocks = raw.reshape(-1, block_bytes)
    d = _f16(blocks, 0)
    if tensor_type == "Q8_0":
        out = d * blocks[:, 2:].view(np.int8).astype(np.float32)
    elif tensor_type == "Q4_0":
        out = d * (_nibbles(blocks[:, 2:]) - 8)
    elif tensor_type == "Q4_1":
        out = d * _nibbles(blocks[:, 4:]) + _f16(blocks, 2)
    elif tensor_type == "Q5_0":
        out = d * (_nibbles(blocks[:, 6:]) + _fifth_bits(blocks[:, 2:6]) - 16)
    else:  # Q5_1
        out = d * (_nibbles(blocks[:, 8:]) + _fifth_bits(blocks[:, 4:8])) + _f16(blocks, 2)
    return out.reshape(raw.shape[0], -1)


def _reference(raw: np.ndarray, tensor_type: str) -> np.ndarray:
    """An implementation independent of `gguf.quants`: the format spec above for F16, BF16 and
    the 32-element blocks, transformers' torch dequantizer for the K-quants and IQ types."""
    if tensor_type == "F32":
        return raw
    if tensor_type == "F16":
        return raw.astype(np.float32)
    if tensor_type == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if tensor_type in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return _reference_legacy(raw, tensor_type)
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    qtype = int(gguf.GGMLQuantizationType[tensor_type])
    return dequant.dequantize(torch.from_numpy(raw.copy()), qtype).reshape(
        raw.shape[0], -1).numpy()


def _random_tensor(rng: np.random.Generator, tensor_type: str, rows: int, cols: int):
    """(data to write, its independent reference dequantization) of one random tensor."""
    if tensor_type == "F32":
        data = rng.standard_normal((rows, cols)).astype(np.float32)
    elif tensor_type == "F16":
        data = rng.standard_normal((rows, cols)).astype(np.float16)
    elif tensor_type == "BF16":
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                    gguf.GGMLQuantizationType.BF16)
    else:
        data = _finite_random_blocks(rng, rows, tensor_type, cols)
    return data, _reference(data, tensor_type)


@pytest.mark.parametrize("tensor_type", SUPPORTED_TENSOR_TYPES)
def test_dequantization_matches_independent_references(tensor_type, tmp_path):
    rows, cols = 6, 512  # two 256-element super-blocks per row for the K-quants
    rng = np.random.default_rng(list(SUPPORTED_TENSOR_TYPES).index(tensor_type))
    data, expected = _random_tensor(rng, tensor_type, rows, cols)
    path = write_raw_gguf(tmp_path / "t.gguf", "llama",
                          {"pad.weight": (np.ones(3, np.float32), "F32"),
                           "x.weight": (data, tensor_type)})
    source = GGUFSource(str(path), "llama", 0, 0, tensor_table(open_gguf(path)))
    tensors = dict(iterate_gguf_tensors(source, torch.float32))
    x = tensors["x.weight"]
    assert tuple(x.shape) == (rows, cols)
    got = x.materialize().numpy()
    reader_tensor = open_gguf(path).tensors[1]
    np.testing.assert_array_equal(
        got, gguf.quants.dequantize(reader_tensor.data, reader_tensor.tensor_type))
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * scale)
    # Slices (tensor parallelism): rows are dequantized alone, columns cut afterwards.
    np.testing.assert_array_equal(x.narrow(0, 2, 3).materialize().numpy(), got[2:5])
    np.testing.assert_array_equal(x.narrow(1, 256, 128).narrow(0, 1, 2).materialize().numpy(),
                                  got[1:3, 256:384])
    assert x.narrow(0, 0, 2).materialize().dtype == torch.float32


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantize_then_load_round_trips(tensor_type, tmp_path):
    """gguf's own quantizer -> file -> our loader stays within the type's step of the input."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    data = x.astype(np.float16) if tensor_type == "F16" else gguf.quants.quantize(x, qtype)
    path = write_raw_gguf(tmp_path / "q.gguf", "llama", {"x.weight": (data, tensor_type)})
    source = GGUFSource(str(path), "llama", 0, 0, tensor_table(open_gguf(path)))
    (_, tensor), = iterate_gguf_tensors(source, torch.float32)
    bits = {"F16": 11, "BF16": 8, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q4_0": 4, "Q4_1": 4}
    step = 2 * float(np.abs(x).max()) / 2 ** bits[tensor_type]
    assert float(np.abs(tensor.materialize().numpy() - x).max()) <= step


def test_loaded_dtype_follows_the_model_dtype(gguf_file):
    source = read_gguf_source(prepare_gguf_view(str(gguf_file("llama", "Q4_1"))))
    tensors = dict(iterate_gguf_tensors(source, torch.bfloat16))
    assert isinstance(tensors["blk.0.ffn_up.weight"], GGUFTensor)
    assert tensors["blk.0.ffn_up.weight"].materialize().dtype == torch.bfloat16
    assert tensors["output_norm.weight"].materialize().dtype == torch.bfloat16


# --------------------------------------------------------------------------- Q/K row order

@pytest.mark.parametrize("num_heads, head_size", [(4, 16), (2, 16), (1, 8), (9, 64)])
def test_unpermute_inverts_llama_cpp_permute(num_heads, head_size):
    g = torch.Generator().manual_seed(num_heads)
    weight = torch.randn(num_heads * head_size, 24, generator=g)
    bias = torch.randn(num_heads * head_size, generator=g)
    for tensor in (weight, bias):
        permuted = torch.from_numpy(llama_cpp_permute(tensor.numpy(), num_heads))
        assert not torch.equal(permuted, tensor)
        assert torch.equal(unpermute_rope_rows(permuted, num_heads), tensor)
    # Rows stay within their head: narrowing by whole heads commutes with the inverse.
    if num_heads > 1:
        permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
        half = num_heads // 2 * head_size
        assert torch.equal(unpermute_rope_rows(permuted[:half], num_heads // 2), weight[:half])
