"""llama.cpp's `glm4moe` GGUF files (GLM-4.5 / 4.6 MoE conversions): the checkpoint view's
config from the file's metadata (`block_count` counts the MTP block, which transformers' save
drops), the tensors under HF names (stacked experts per expert), routed experts kept in their
GGUF blocks, and malformed files refused naming the key or tensor.

Oracle: HF transformers on the safetensors checkpoint the file was converted from
(tests/fixtures/gguf_converted.py writes what convert_hf_to_gguf.py writes; checked identical,
metadata and tensors, with the real converter of llama-cpp-python 0.3.36 at F32 / F16 / Q8_0):
greedy tokens equal and logprobs within 1e-4 at F32, tokens equal at F16; at Q8_0 the
quantized-expert path equals the same file loaded dequantized, and `pagedllm verify
--reference` passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM
from pagedllm.entrypoints.cli import main
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.model_loader.gguf import prepare_gguf_view
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.gguf_converted import write_converted_gguf
from tests.models.test_deepseek import build_checkpoint
from tests.models.test_gemma import _params, _prompts, _tokens_and_logprobs, hf_greedy_reference

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
# Q8_0 rounding of the fixtures' default weights (initializer_range 0.5: logits of tens)
# moves logprobs by ~1, past verify's near-tie tolerance; 0.2 keeps them within ~0.1.
VERIFY_INIT = {"initializer_range": 0.2}


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("glm4moe_views")))
    patch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")   # exact float activations
    yield
    patch.undo()


@pytest.fixture(scope="module")
def files(tmp_path_factory, byte_level_tokenizer_dir):
    """files(outtype, init="default") -> (checkpoint folder, .gguf file), built on first use;
    init "verify" builds the checkpoint with VERIFY_INIT, "mtp" the default one plus an MTP
    block (`add_mtp_block`)."""
    root = tmp_path_factory.mktemp("glm4moe_gguf")
    checkpoints: dict[str, Path] = {}
    made: dict[tuple[str, str], Path] = {}

    def get(outtype: str = "F32", init: str = "default") -> tuple[Path, Path]:
        if init not in checkpoints:
            checkpoints[init] = build_checkpoint("glm4_moe", root / init,
                                                 byte_level_tokenizer_dir,
                                                 VERIFY_INIT if init == "verify" else None)
            if init == "mtp":
                add_mtp_block(checkpoints[init])
        if (init, outtype) not in made:
            made[init, outtype] = write_converted_gguf(
                checkpoints[init], root / f"{init}-{outtype}.gguf", outtype)
        return checkpoints[init], made[init, outtype]

    return get


def add_mtp_block(path: Path) -> None:
    """Append the MTP block the config's num_nextn_predict_layers = 1 announces
    (`model.layers.3.*`: a copy of layer 2's decoder tensors plus random eh_proj, the norms and
    the copies of the embedding and head that released GLM-4.5 checkpoints carry)."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    h = tensors["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(3)
    block = {name.replace("model.layers.2.", "model.layers.3."): t.clone()
             for name, t in tensors.items() if name.startswith("model.layers.2.")}
    for name, t in (("eh_proj.weight", torch.randn(h, 2 * h, generator=g) * 0.1),
                    ("enorm.weight", torch.ones(h)), ("hnorm.weight", torch.ones(h)),
                    ("shared_head.norm.weight", torch.ones(h)),
                    ("embed_tokens.weight", tensors["model.embed_tokens.weight"].clone()),
                    ("shared_head.head.weight", tensors["lm_head.weight"].clone())):
        block[f"model.layers.3.{name}"] = t
    save_file({**tensors, **block}, str(file), metadata={"format": "pt"})


def _run(model: Path, **kwargs) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(str(model), **{**ENGINE_ARGS, **kwargs})
    return _tokens_and_logprobs(llm.generate(_prompts(), _params(), use_tqdm=False))


def test_view_config_is_the_checkpoints(files):
    checkpoint, gguf_file = files()
    view = json.loads((Path(prepare_gguf_view(str(gguf_file))) / "config.json").read_text())
    want = json.loads((checkpoint / "config.json").read_text())
    assert view["architectures"] == ["Glm4MoeForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob",
                "routed_scaling_factor", "use_qk_norm", "attention_bias", "vocab_size",
                "tie_word_embeddings", "num_nextn_predict_layers"):
        assert view[key] == want[key], key
    assert view["rope_parameters"] == pytest.approx(want["rope_parameters"])


def test_f32_file_greedy_and_logprobs_equal_hf(files):
    checkpoint, gguf_file = files("F32")
    want_tokens, want_logprobs, _ = hf_greedy_reference(checkpoint)
    tokens, logprobs = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])),
                               torch.tensor(sum(want_logprobs, [])), atol=1e-4, rtol=0)


@pytest.mark.slow   # deepseek2 files with MTP blocks are checked by default
def test_mtp_block_is_skipped(files):
    """A file converted from a checkpoint that holds its MTP block (blk.3.*, with the
    converter's `nextn.*` tensors; block_count 4) runs the 3 decoder layers only: the same
    tokens and logprobs as the file without it."""
    _, plain = files("F32")
    _, with_mtp = files("F32", init="mtp")
    tokens, logprobs = _run(with_mtp, quantization="none")
    want_tokens, want_logprobs = _run(plain, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])),
                               torch.tensor(sum(want_logprobs, [])), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_f16_file_greedy_equals_hf(files):
    checkpoint, gguf_file = files("F16")
    want_tokens, _, _ = hf_greedy_reference(checkpoint)
    tokens, _ = _run(gguf_file, quantization="none")
    assert tokens == want_tokens


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_q8_0_experts_stay_in_blocks_and_equal_the_dequantized_load(files):
    _, gguf_file = files("Q8_0")
    llm = LLM(str(gguf_file), quantization="gguf", **ENGINE_ARGS)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2   # layers 1 and 2 (layer 0 is dense)
    assert all(m.gguf_expert_types == {"w13": "Q8_0", "w2": "Q8_0"} for m in moes)
    # 8 experts x [2 x 32 rows of 64 + 64 rows of 32]: 2 and 1 blocks of 34 bytes per row.
    assert all(m.w13_weight.dtype == torch.uint8 and m.w13_weight.shape == (8, 64, 68)
               and m.w2_weight.shape == (8, 64, 34) for m in moes)
    tokens, logprobs = _tokens_and_logprobs(llm.generate(_prompts(), _params(),
                                                         use_tqdm=False))
    del llm
    want_tokens, want_logprobs = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])),
                               torch.tensor(sum(want_logprobs, [])), atol=1e-4, rtol=0)


def test_verify_passes_on_the_q8_0_file(files, capsys):
    checkpoint, gguf_file = files("Q8_0", init="verify")
    argv = ["verify", str(gguf_file), "--reference", str(checkpoint), "--max-tokens", "8",
            "--num-prompts", "4", "--kv-cache-memory-bytes", str(8 << 20), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and max(p["max_logprob_diff"] for p in report["prompts"]) < 0.2


@pytest.mark.parametrize("change,message", [
    (dict(drop_tensors=("blk.2.ffn_up_exps.weight",)), "model.layers.2.mlp.experts"),
    (dict(metadata_overrides={"glm4moe.expert_gating_func": 1}), "glm4moe.expert_gating_func"),
    (dict(metadata_overrides={"glm4moe.expert_count": None}), "glm4moe.expert_count"),
    (dict(metadata_overrides={"glm4moe.nextn_predict_layers": 4}),
     "glm4moe.nextn_predict_layers = 4 leave no decoder layer"),
    (dict(metadata_overrides={"glm4moe.rope.scaling.type": "linear"}),
     "glm4moe.rope.scaling.type"),
])
def test_malformed_files_fail_at_load_naming_the_key(files, tmp_path, change, message):
    checkpoint, _ = files()
    bad = write_converted_gguf(checkpoint, tmp_path / "bad.gguf", "F32", **change)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        LLM(str(bad), quantization="none", **ENGINE_ARGS)
