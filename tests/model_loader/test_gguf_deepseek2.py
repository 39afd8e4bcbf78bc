"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2-Lite / V3 conversions): the checkpoint view's
config from the file's metadata, the tensors under HF names (kv_b_proj rebuilt from attn_k_b /
attn_v_b, stacked experts per expert), routed experts kept in their GGUF blocks, and
malformed files refused naming the key or tensor.

Oracle: the safetensors checkpoint the file was converted from (tests/fixtures/gguf_converted.py
writes what convert_hf_to_gguf.py writes; checked identical, tensor by tensor, with the real
converter of llama-cpp-python 0.3.36 at F32 / F16 / Q8_0): greedy tokens equal and logprobs
within 1e-4 at F32, tokens equal at F16; the quantized-expert path equals the same file loaded
dequantized. `pagedllm verify --reference` passes on the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.verify import load_reference_model
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.model_loader.gguf import prepare_gguf_view
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.gguf_converted import write_converted_gguf
from tests.models.test_deepseek import build_checkpoint

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
# The files store one YaRN mscale (mscale_all_dim); released DeepSeek configs have
# mscale == mscale_all_dim, so the test checkpoint does too (models/deepseek_gguf.py).
V2_LITE = {"rope_parameters": dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                   original_max_position_embeddings=128, mscale=0.707,
                                   mscale_all_dim=0.707, beta_fast=32, beta_slow=1)}
# Released V3 configs name their scoring function; the converter writes it as gating func 2.
V3 = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


@pytest.fixture(scope="module", autouse=True)
def gguf_view_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path_factory.mktemp("deepseek2_views")))
    patch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")   # exact float activations
    yield
    patch.undo()


@pytest.fixture(scope="module")
def files(tmp_path_factory, byte_level_tokenizer_dir):
    """files(variant, outtype) -> (checkpoint folder, .gguf file), built on first use."""
    root = tmp_path_factory.mktemp("deepseek2_gguf")
    checkpoints: dict[str, Path] = {}
    made: dict[tuple[str, str], Path] = {}

    def get(variant: str, outtype: str = "F32") -> tuple[Path, Path]:
        if variant not in checkpoints:
            overrides = V2_LITE if variant == "v2_lite" else V3
            checkpoints[variant] = build_checkpoint(variant, root / variant,
                                                    byte_level_tokenizer_dir, overrides)
        if (variant, outtype) not in made:
            made[variant, outtype] = write_converted_gguf(
                checkpoints[variant], root / f"{variant}-{outtype}.gguf", outtype)
        return checkpoints[variant], made[variant, outtype]

    return get


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=g).tolist()}
            for n in (1, 6, 23)]


def _run(model: Path, **kwargs) -> tuple[list[list[int]], list[float]]:
    llm = LLM(str(model), **{**ENGINE_ARGS, **kwargs})
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [step[t].logprob for o in outs
                for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    return tokens, logprobs


def test_v2_lite_view_config_is_the_checkpoints(files):
    checkpoint, gguf_file = files("v2_lite")
    view = json.loads((Path(prepare_gguf_view(str(gguf_file))) / "config.json").read_text())
    want = json.loads((checkpoint / "config.json").read_text())
    assert view["architectures"] == ["DeepseekV2ForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
                "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
                "topk_method", "norm_topk_prob", "routed_scaling_factor", "vocab_size",
                "tie_word_embeddings"):
        assert view[key] == want[key], key
    assert view["rope_parameters"] == pytest.approx(want["rope_parameters"])


@pytest.mark.parametrize("variant", ["v2_lite", pytest.param("v3", marks=pytest.mark.slow)])
def test_f32_file_greedy_equals_the_safetensors_checkpoint(files, variant):
    checkpoint, gguf_file = files(variant, "F32")
    want_tokens, want_logprobs = _run(checkpoint)
    tokens, logprobs = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
def test_f16_file_greedy_equals_the_safetensors_checkpoint(files):
    checkpoint, gguf_file = files("v2_lite", "F16")
    want_tokens, want_logprobs = _run(checkpoint)
    tokens, logprobs = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    # fp16 weights (the fixture's init range 0.5 gives logits of tens): ~1e-2 moves.
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=5e-2, rtol=0)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_q8_0_experts_stay_in_blocks_and_equal_the_dequantized_load(files):
    _, gguf_file = files("v2_lite", "Q8_0")
    llm = LLM(str(gguf_file), quantization="gguf", **ENGINE_ARGS)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.gguf_expert_types == {"w13": "Q8_0", "w2": "Q8_0"} for m in moes)
    # 8 experts x [2 x 32 rows + 64 rows] x 2 blocks x 34 bytes: the file's own bytes.
    assert all(m.w13_weight.dtype == torch.uint8 and m.w13_weight.shape == (8, 64, 68)
               and m.w2_weight.shape == (8, 64, 34) and m.gguf_grouped for m in moes)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    del llm
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [step[t].logprob for o in outs
                for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    want_tokens, want_logprobs = _run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


def test_default_quantization_falls_back_where_a_linear_cannot_keep_blocks(files):
    # V3's q_b_proj reads q_lora_rank = 24 columns, no whole 32-weight block: the converter
    # stores it in F16 and the default load dequantizes the file instead of failing.
    _, gguf_file = files("v3", "Q8_0")
    llm = LLM(str(gguf_file), **ENGINE_ARGS)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert all(m.quant_method is None for m in model.modules() if isinstance(m, FusedMoE))
    with pytest.raises(ValueError, match="block boundaries"):
        LLM(str(gguf_file), quantization="gguf", **ENGINE_ARGS)


@pytest.mark.slow
def test_verify_passes_against_the_checkpoint(files, capsys):
    # (F32: the fixture's init range 0.5 makes Q8_0's rounding move logprobs by ~1.)
    checkpoint, gguf_file = files("v2_lite", "F32")
    argv = ["verify", str(gguf_file), "--reference", str(checkpoint), "--max-tokens", "6",
            "--num-prompts", "3", "--kv-cache-memory-bytes", str(8 << 20), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and max(p["max_logprob_diff"] for p in report["prompts"]) < 1e-3


def test_verify_without_a_reference_says_to_pass_one(files):
    _, gguf_file = files("v2_lite")
    with pytest.raises(ValueError, match="--reference"):
        load_reference_model(str(gguf_file))


@pytest.mark.parametrize("change,message", [
    (dict(drop_tensors=("blk.1.attn_v_b.weight",)), "blk.1.attn_v_b.weight"),
    (dict(drop_tensors=("blk.2.ffn_down_exps.weight",)), "model.layers.2.mlp.experts"),
    (dict(metadata_overrides={"deepseek2.rope.scaling.type": "longrope"}),
     "deepseek2.rope.scaling.type"),
    (dict(metadata_overrides={"deepseek2.expert_gating_func": 3}),
     "deepseek2.expert_gating_func"),
    (dict(metadata_overrides={"deepseek2.attention.kv_lora_rank": None}),
     "deepseek2.attention.kv_lora_rank"),
])
def test_malformed_files_fail_at_load_naming_the_key(files, tmp_path, change, message):
    checkpoint, _ = files("v2_lite")
    bad = write_converted_gguf(checkpoint, tmp_path / "bad.gguf", "F32", **change)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        LLM(str(bad), quantization="none", **ENGINE_ARGS)
