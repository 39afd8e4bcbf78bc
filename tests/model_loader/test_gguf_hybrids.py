"""llama.cpp's GGUF files of the hybrid families: `lfm2` (LFM2 short-conv + attention),
`mamba2` (its config read from the file's `mamba2.ssm.*` keys), `qwen3next` (Gated DeltaNet +
gated attention, experts with a shared expert; its config read from the file too), `qwen35`
(Qwen3.5's dense text model; the converter tiles its value heads), `granitehybrid` (Granite 4
hybrid) and `falcon-h1` (multipliers folded into the weights).

Oracle: the safetensors checkpoint the file was converted from (tests/fixtures/gguf_converted.py
writes what convert_hf_to_gguf.py writes: checked identical, metadata and tensor by tensor, with
the real converter of llama-cpp-python 0.3.36 at F32 and Q8_0 for all six families;
test_gguf_llamacpp_converter.py repeats that check where the converter is installed):
greedy tokens equal and logprobs within 1e-4 at F32 (Qwen3-Next: HF transformers' own greedy
decoding); a Q8_0 file's linear layers (and Qwen3-Next's experts) stay in blocks and equal the
dequantized load; malformed files fail at load naming the tensor or key.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_converted import spell_layer_types_as_the_hub, write_converted_gguf
from tests.models.test_hybrid_models import MODELS, _hf_greedy, _prompts

# Qwen3-Next as llama.cpp runs it: every layer sparse (its converter maps no dense MLP), equal
# key and value head sizes (its loader sizes the gated norm by the key head size), 3 Gated
# DeltaNet layers to 1 attention layer (the converter's default full_attention_interval, 4, as
# the config does not store it), sizes that fall on 32-weight blocks; norms not all zero, so a
# lost `1 + w` shows.
QWEN3_NEXT = ("Qwen3NextForCausalLM", dict(
    layer_types=["linear_attention"] * 3 + ["full_attention"], num_hidden_layers=4,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True,
    norm_weight_std=0.1, seed=1))
# Qwen3-Next whose attention layer is not every fourth: the layer types come from the file's
# `attention.recurrent_layers` flags.
QWEN3_NEXT_MIXED = ("Qwen3NextForCausalLM", {
    **QWEN3_NEXT[1], "layer_types": ["linear_attention", "full_attention"] * 2})
# Qwen3.5 with value heads of 32 weights (4 to 2 key heads): `ssm_out`'s columns, tiled by the
# converter, are re-ordered in whole Q8_0 blocks.
QWEN3_5_BLOCKS = ("Qwen3_5ForCausalLM", {**MODELS["qwen3_5"][1], "linear_value_head_dim": 32})
# Granite 4 hybrid as Granite 4.0-H (no RoPE: llama.cpp applies it only to Bamba or a model
# without Mamba layers), a shared MLP on whole 32-weight blocks; Falcon-H1 with its muP
# multipliers and gated norm, the norm after the gate (llama.cpp's order) and `head_dim` set
# (the converter requires it).
GRANITE_HYBRID = ("GraniteMoeHybridForCausalLM",
                  {**MODELS["granite_hybrid"][1], "position_embedding_type": "nope",
                   "shared_intermediate_size": 64})
FALCON_H1 = ("FalconH1ForCausalLM", {**MODELS["falcon_h1"][1], "head_dim": 16,
                                     "mamba_norm_before_gate": False})
FAMILIES = {**MODELS, "qwen3_next": QWEN3_NEXT, "qwen3_next_mixed": QWEN3_NEXT_MIXED,
            "qwen3_5_blocks": QWEN3_5_BLOCKS, "granite_hybrid": GRANITE_HYBRID,
            "falcon_h1": FALCON_H1}

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
    """files(family, outtype, **writer options) -> (checkpoint folder, .gguf file), built on
    first use."""
    root = tmp_path_factory.mktemp("hybrid_gguf")
    checkpoints: dict = {}

    def get(family: str, outtype: str = "F32", **options):
        if family not in checkpoints:
            checkpoints[family] = make_tiny_checkpoint(root / family, FAMILIES[family][0],
                                                       byte_level_tokenizer_dir,
                                                       **FAMILIES[family][1])
            spell_layer_types_as_the_hub(checkpoints[family])
        out = root / f"{family}-{outtype}{''.join(sorted(options))}.gguf"
        if not out.exists():
            write_converted_gguf(checkpoints[family], out, outtype, **options)
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


def assert_blocks_equal_the_dequantized_load(run, gguf_file, check_blocks, atol: float = 1e-4):
    """Run `gguf_file` with its tensors kept in blocks (`quantization="gguf"`), hand the loaded
    model to `check_blocks` (which asserts the layers that stay in blocks), then run the
    dequantized load of the same file: same greedy tokens, chosen-token logprobs within `atol`.
    `run(model, **engine_kwargs)` returns (tokens, logprobs, llm) as the tests' `_run`s do."""
    tokens, logprobs, llm = run(gguf_file, quantization="gguf")
    check_blocks(llm.llm_engine.engine_core.executor.worker.model_runner.model)
    del llm
    want_tokens, want_logprobs, _ = run(gguf_file, quantization="none")
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=atol, rtol=0)


def assert_experts_in_blocks(model, quant_type: str = "Q8_0") -> None:
    """Every fused-MoE layer of `model` keeps both expert tensors in `quant_type` blocks."""
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.gguf_expert_types == {"w13": quant_type, "w2": quant_type}
                        for m in moes)


@pytest.mark.parametrize("family", ["lfm2", "mamba2", "qwen3_5", "qwen3_next_mixed",
                                    "granite_hybrid", "falcon_h1"])
def test_f32_file_greedy_equals_the_safetensors_checkpoint(files, family):
    """(Qwen3.5: value heads tiled in the file, taken back at load; Qwen3-Next's layer types
    from `attention.recurrent_layers`.)"""
    checkpoint, gguf_file = files(family)
    want_tokens, want_logprobs, _ = _run(checkpoint)
    tokens, logprobs, llm = _run(gguf_file, quantization="none")
    config = llm.llm_engine.engine_core.executor.worker.model_runner.model.config
    if family == "mamba2":
        assert (config.num_heads, config.n_groups, config.state_size) == (8, 2, 16)
    elif family == "granite_hybrid":
        assert list(config.layers_block_type) == ["linear_attention", "full_attention",
                                                  "linear_attention"]
        assert config.position_embedding_type == "nope"
    elif family == "falcon_h1":   # the multipliers come folded into the weights
        assert (config.ssm_multipliers, config.key_multiplier) == ([1.0] * 5, 1.0)
    else:
        assert list(config.layer_types) == FAMILIES[family][1]["layer_types"]
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
@pytest.mark.parametrize("family", ["lfm2", "mamba2"])
def test_q8_0_file_stays_in_blocks_and_equals_the_dequantized_load(files, family):
    _, gguf_file = files(family, "Q8_0")

    def check_blocks(model):
        linear = (model.model.layers[0].conv.in_proj if family == "lfm2"
                  else model.backbone.layers[0].mixer.in_proj)
        assert linear.gguf_quant_type == "Q8_0"

    assert_blocks_equal_the_dequantized_load(_run, gguf_file, check_blocks)


@pytest.fixture(scope="module")
def qwen3_next_hf(files):
    """[(tokens, logprobs)] of HF's float32 greedy decoding of `_prompts()` (70, 40, 5, 1 and 19
    tokens: the 70 spans two of the delta rule's 64-token scan chunks) on the Qwen3-Next
    checkpoint."""
    checkpoint, _ = files("qwen3_next")
    return _hf_greedy(checkpoint, "qwen3_next", torch.float32)


def _run_hf_prompts(model, **kwargs) -> tuple[list[list[int]], list[list[float]], LLM]:
    """Greedy tokens and chosen-token logprobs per prompt of `_prompts()` (8 tokens, as HF's)."""
    llm = LLM(str(model), **{**ENGINE_ARGS, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                        use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
             for o in outs], llm)


@pytest.mark.slow   # HF's Qwen3-Next reference is slow; the Q8_0 file check stays default
def test_qwen3next_f32_file_greedy_equals_hf(files, qwen3_next_hf):
    _, gguf_file = files("qwen3_next")
    tokens, logprobs, llm = _run_hf_prompts(gguf_file, quantization="none")
    config = llm.llm_engine.engine_core.executor.worker.model_runner.model.config
    assert list(config.layer_types) == QWEN3_NEXT[1]["layer_types"]
    assert (config.linear_num_value_heads, config.linear_value_head_dim,
            config.rope_parameters["partial_rotary_factor"]) == (4, 16, 0.25)
    assert tokens == [want for want, _ in qwen3_next_hf]
    torch.testing.assert_close(torch.tensor(logprobs),
                               torch.tensor([lps for _, lps in qwen3_next_hf]),
                               atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(legacy_qkvz=True), dict(nextn_layers=1)],
                         ids=["legacy_ssm_in", "mtp_block"])
def test_qwen3next_other_file_layouts_equal_the_converters(files, options):
    """The converter's earlier layout (HF's grouped `in_proj_qkvz` whole, as `ssm_in`) loads
    into the same weights as its `attn_qkv` + `attn_gate`, and a file with an MTP block after
    the model's (later converters) loads the model's: identical outputs."""
    _, plain = files("qwen3_next")
    _, other = files("qwen3_next", **options)
    want_tokens, want_logprobs, _ = _run(plain, quantization="none")
    tokens, logprobs, llm = _run(other, quantization="none")
    assert len(llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers) == 4
    assert (tokens, logprobs) == (want_tokens, want_logprobs)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_qwen3next_q8_0_file_keeps_layers_and_experts_in_blocks(files):
    _, gguf_file = files("qwen3_next", "Q8_0")

    def check_blocks(model):
        delta_net = model.model.layers[0].linear_attn
        # in_proj_b / in_proj_a: rows of the one `ssm_ba` tensor, re-ordered in their blocks
        assert {delta_net.in_proj_qkv.gguf_quant_type, delta_net.in_proj_z.gguf_quant_type,
                delta_net.in_proj_b.gguf_quant_type, delta_net.in_proj_a.gguf_quant_type,
                model.model.layers[3].self_attn.q_proj.gguf_quant_type} == {"Q8_0"}
        assert len([m for m in model.modules() if isinstance(m, FusedMoE)]) == 4
        assert_experts_in_blocks(model)

    assert_blocks_equal_the_dequantized_load(_run, gguf_file, check_blocks)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_qwen35_q8_0_file_keeps_reordered_layers_in_blocks(files):
    """The value-head order is undone on the blocks: rows of `attn_qkv` / `attn_gate` /
    `ssm_beta` / `ssm_alpha`, whole blocks of `ssm_out`'s columns."""
    _, gguf_file = files("qwen3_5_blocks", "Q8_0")

    def check_blocks(model):
        delta_net = model.model.layers[0].linear_attn
        assert {delta_net.in_proj_qkv.gguf_quant_type, delta_net.in_proj_z.gguf_quant_type,
                delta_net.out_proj.gguf_quant_type} == {"Q8_0"}

    assert_blocks_equal_the_dequantized_load(_run, gguf_file, check_blocks)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
def test_qwen35_columns_across_blocks_dequantize_by_default(files):
    """Value heads of 8 weights: `ssm_out`'s column order cuts through its Q8_0 blocks, so the
    default quantization loads the file dequantized (an explicit 'gguf' refuses)."""
    _, gguf_file = files("qwen3_5", "Q8_0")
    with pytest.raises(ValueError, match=r"blk\.0\.ssm_out"):
        LLM(str(gguf_file), quantization="gguf", **ENGINE_ARGS)
    tokens, logprobs, _ = _run(gguf_file)
    want_tokens, want_logprobs, _ = _run(gguf_file, quantization="none")
    assert (tokens, logprobs) == (want_tokens, want_logprobs)


@pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")
@pytest.mark.parametrize("family", ["granite_hybrid",
                                    pytest.param("falcon_h1", marks=pytest.mark.slow)])
def test_mamba_hybrid_q8_0_file_stays_in_blocks_and_equals_the_dequantized_load(files, family):
    """Granite: attn_q / attn_k un-permuted on the blocks, the shared MLP's halves and the
    experts in blocks; Falcon-H1: its projections with the multipliers folded in."""
    _, gguf_file = files(family, "Q8_0")

    def check_blocks(model):
        layers = model.model.layers
        if family == "granite_hybrid":
            assert {layers[0].mamba.in_proj.gguf_quant_type,
                    layers[1].self_attn.q_proj.gguf_quant_type,
                    layers[1].shared_mlp.input_linear.gguf_quant_type} == {"Q8_0"}
            assert_experts_in_blocks(model)
        else:
            assert {layers[0].mamba.in_proj.gguf_quant_type,
                    layers[0].self_attn.k_proj.gguf_quant_type,
                    layers[0].feed_forward.gate_proj.gguf_quant_type} == {"Q8_0"}

    assert_blocks_equal_the_dequantized_load(_run, gguf_file, check_blocks)


@pytest.mark.parametrize("family,change,message", [
    ("lfm2", dict(drop_tensors=("blk.2.shortconv.in_proj.weight",)),
     r"model\.layers\.2\.conv\.in_proj"),
    ("mamba2", dict(drop_tensors=("blk.1.ssm_a",)), r"backbone\.layers\.1\.mixer\.A_log"),
    ("mamba2", dict(metadata_overrides={"mamba2.ssm.inner_size": None}),
     r"mamba2\.ssm\.inner_size"),
    ("qwen3_next", dict(drop_tensors=("blk.2.attn_gate.weight",)),
     r"model\.layers\.2\.linear_attn\.in_proj_z"),
    ("qwen3_next", dict(metadata_overrides={"qwen3next.ssm.time_step_rank": 3}),
     r"qwen3next\.ssm\.time_step_rank = 3"),
    ("qwen3_next", dict(metadata_overrides={"qwen3next.expert_count": None}),
     r"qwen3next\.expert_count"),
    ("qwen3_next_mixed",
     dict(metadata_overrides={"qwen3next.attention.recurrent_layers": [True, False]}),
     r"qwen3next\.attention\.recurrent_layers"),
    ("qwen3_5", dict(drop_tensors=("blk.0.ssm_alpha.weight",)),
     r"model\.layers\.0\.linear_attn\.in_proj_a"),
    ("qwen3_5", dict(metadata_overrides={"qwen35.ssm.group_count": 3}),
     r"qwen35\.ssm\.group_count = 3"),
    ("granite_hybrid", dict(metadata_overrides={"granitehybrid.attention.head_count_kv": [0, 2]}),
     r"granitehybrid\.attention\.head_count_kv"),
    ("falcon_h1", dict(drop_tensors=("blk.1.ffn_norm",)),
     r"model\.layers\.1\.pre_ff_layernorm"),
])
def test_malformed_file_fails_at_load_naming_it(files, tmp_path, family, change, message):
    checkpoint, _ = files(family)
    bad = write_converted_gguf(checkpoint, tmp_path / "bad.gguf", "F32", **change)
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), quantization="none", **ENGINE_ARGS)
