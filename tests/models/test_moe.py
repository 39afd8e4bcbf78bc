"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and the FusedMoE layer.

Oracles (DESIGN.md §6): HF `transformers` in fp32 on tiny random checkpoints (greedy tokens
equal, logprobs of generated and prompt tokens within fp32 noise); the engine against itself
(chunked prefill and batching change nothing; tensor parallelism, slow); and the fused layer
against a naive per-token loop over each token's experts.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE, fused_experts, select_experts
from pagedllm.layers.activation import SiluAndMul
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock
from tests.distributed.common import run
from tests.fixtures.checkpoints import DEFAULT_INITIALIZER_RANGE
from tests.models.test_gemma import (VOCAB_HIGH, VOCAB_LOW, _params, _prompts,
                                     _tokens_and_logprobs, assert_matches_hf,
                                     hf_greedy_reference)

_BASE: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=1024,
                             initializer_range=DEFAULT_INITIALIZER_RANGE, rms_norm_eps=1e-6,
                             tie_word_embeddings=False)
# name -> (architecture, config class, config overrides on _BASE).
MOE_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # 8 experts, top-2, renormalised (always, for Mixtral).
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    # Shared expert with its sigmoid gate, q/k/v biases, layer 2 dense (mlp_only_layers), no
    # renormalisation, tied embeddings.
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(intermediate_size=128, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                       mlp_only_layers=[2], tie_word_embeddings=True)),
    # The 60-expert top-4 shape of Qwen1.5-MoE; only layers 1 and 3 sparse (decoder_sparse_step).
    "qwen2_moe_60x4": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                       dict(intermediate_size=96, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, num_experts=60,
                            num_experts_per_tok=4, decoder_sparse_step=2)),
    # Per-head q/k norms, explicit head_dim, norm_topk_prob.
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=32)),
    # q/k norms over the whole projection, clip_qkv low enough to clamp.
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=3.0)),
    # One KV head: under tp=2 both ranks hold it, and its k norm counts it once per replica.
    "olmoe_mqa": ("OlmoeForCausalLM", "OlmoeConfig",
                  dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                       num_key_value_heads=1, num_hidden_layers=2)),
}
# qwen2_moe_60x4 (many experts) and OLMoE in the slow run; the others by default.
HF_VARIANTS = ["mixtral", "qwen2_moe", pytest.param("qwen2_moe_60x4", marks=pytest.mark.slow),
               "qwen3_moe", pytest.param("olmoe", marks=pytest.mark.slow)]


def _build(name: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    """Save MOE_VARIANTS[name] with seeded random weights (fp32) and the tokenizer."""
    arch, config_class, overrides = MOE_VARIANTS[name]
    out_dir.mkdir(parents=True)
    for path in tokenizer_dir.iterdir():
        if path.is_file():
            shutil.copy(path, out_dir / path.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    config = getattr(transformers, config_class)(
        **{**_BASE, **overrides}, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory, byte_level_tokenizer_dir):
    """variant -> checkpoint folder, built on first use."""
    root = tmp_path_factory.mktemp("moe_checkpoints")
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            paths[name] = _build(name, root / name, byte_level_tokenizer_dir)
        return paths[name]

    return get


@pytest.fixture(scope="module")
def hf_reference(moe_checkpoints):
    """variant -> (greedy tokens, their logprobs, prompt-token logprobs) from HF in fp32."""
    cache: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = hf_greedy_reference(moe_checkpoints(variant))
        return cache[variant]

    return get


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, **kwargs)


def _model(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.model


# ---------------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_greedy_and_logprobs_match_hf(moe_checkpoints, hf_reference, variant):
    llm = _llm(moe_checkpoints(variant))
    model = _model(llm)
    assert isinstance(model, MoeForCausalLM)
    arch, _, overrides = MOE_VARIANTS[variant]
    assert type(model).__name__ == arch
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    expected_sparse = {"qwen2_moe": 3, "qwen2_moe_60x4": 2}.get(variant, 4)
    assert len(blocks) == expected_sparse
    assert all((b.shared_expert is not None) == (arch == "Qwen2MoeForCausalLM") for b in blocks)
    assert_matches_hf(llm, *hf_reference(variant))


@pytest.mark.parametrize("variant", ["qwen2_moe", pytest.param("olmoe", marks=pytest.mark.slow)])
def test_chunked_prefill_batching_and_prefix_caching_change_nothing(moe_checkpoints, variant):
    """One request at a time, whole prompts in one step, no cache vs. up to 3 requests in steps
    of 11 tokens (prefill chunks and decodes of other requests share the expert GEMMs) with
    two later requests served a 32-token shared prefix from the prefix cache."""
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(37)]
    prompts = _prompts()[1::2] + [prefix + [rng.randrange(VOCAB_LOW, VOCAB_HIGH)
                                            for _ in range(n)] for n in (2, 9, 14)]
    path = moe_checkpoints(variant)
    reference = _llm(path, enable_prefix_caching=False, max_num_batched_tokens=2048)
    alone = [_tokens_and_logprobs(reference.generate([p], _params(), use_tqdm=False))
             for p in prompts]
    want_tokens = [a[0][0] for a in alone]
    want_logprobs = sum((a[1][0] for a in alone), [])
    llm = _llm(path, enable_prefix_caching=True, block_size=8, max_num_batched_tokens=11,
               max_num_seqs=3)
    outputs = llm.generate(prompts[:3], _params(), use_tqdm=False)
    outputs += [llm.generate(p, _params(), use_tqdm=False)[0] for p in prompts[3:]]
    assert [o.num_cached_tokens for o in outputs[-2:]] == [32, 32]
    tokens, logprobs = _tokens_and_logprobs(outputs)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(want_logprobs),
                               atol=2e-4, rtol=0)


def test_ngram_speculative_decoding_and_preemption_change_nothing(moe_checkpoints):
    """Greedy tokens of a MoE model with n-gram drafts verified in one step (several tokens per
    request through the expert GEMMs), and with a KV cache so small that requests are preempted
    and recomputed, equal plain decoding."""
    rng = random.Random(2)
    motif = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(6)]
    prompts = [motif * 5 + [rng.randrange(VOCAB_LOW, VOCAB_HIGH)] for _ in range(3)] + _prompts()[:3]
    path = moe_checkpoints("mixtral")
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in _llm(path).generate(prompts, greedy,
                                                                        use_tqdm=False)]
    spec = _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3})
    assert [list(o.outputs[0].token_ids)
            for o in spec.generate(prompts, greedy, use_tqdm=False)] == want
    small = LLM(str(path), dtype="float32", num_gpu_blocks_override=20, block_size=8,
                max_model_len=128)
    assert [list(o.outputs[0].token_ids)
            for o in small.generate(prompts, greedy, use_tqdm=False)] == want
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_fused_expert_checkpoint_names_load_the_same(moe_checkpoints, tmp_path):
    """transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj` tensors (written with
    save_original_format=False) load into the same weights as the per-expert names."""
    path = moe_checkpoints("mixtral")
    fused_dir = tmp_path / "mixtral_fused"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(fused_dir, save_original_format=False)
    for f in path.iterdir():
        if not (fused_dir / f.name).exists():
            shutil.copy(f, fused_dir / f.name)
    with safe_open(str(fused_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    per_expert = dict(_model(_llm(path)).named_parameters())
    fused = dict(_model(_llm(fused_dir)).named_parameters())
    assert per_expert.keys() == fused.keys()
    for name, param in per_expert.items():
        torch.testing.assert_close(fused[name], param, atol=0, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("variant, parallel", [
    ("qwen2_moe", dict(tensor_parallel_size=2)),
    ("olmoe", dict(tensor_parallel_size=2)),
    ("olmoe_mqa", dict(tensor_parallel_size=2)),
    ("qwen2_moe", dict(pipeline_parallel_size=2)),
])
def test_parallel_matches_single_process(moe_checkpoints, variant, parallel):
    """tp=2 (two worker processes, gloo): experts sharded on their intermediate dimension,
    OLMoE's whole-projection q/k norms all-reduced; pp=2: a dense and a sparse layer per
    stage. Same greedy tokens as one process."""
    path = moe_checkpoints(variant)
    params = [SamplingParams(max_tokens=10, temperature=0.0)]
    assert run(path, params, distributed_executor_backend="mp", **parallel) == run(path, params)


# ---------------------------------------------------------------------------------- the layer

def _naive_moe(hidden, router_logits, w13, w2, top_k, renormalize, local_experts=None):
    """Per token: softmax over experts, top-k, (renormalise), sum of weight * expert MLP; only
    experts in `local_experts` (default all) contribute. w13/w2 indexed by logical expert."""
    out = torch.zeros_like(hidden)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        probs = torch.softmax(router_logits[t].double(), -1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            if local_experts is not None and e not in local_experts:
                continue
            h = w13[e].double() @ hidden[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += (w * (w2[e].double() @ act)).to(out.dtype)
    return out


@pytest.mark.parametrize("top_k, renormalize", [(2, True), (3, False), (8, True)])
def test_fused_moe_matches_naive_per_token_loop(top_k, renormalize):
    torch.manual_seed(0)
    num_experts, hidden_size, inter, n = 8, 32, 24, 41
    layer = FusedMoE(num_experts, top_k, hidden_size, inter, renormalize)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size) / hidden_size ** 0.5
    w2 = torch.randn(num_experts, hidden_size, inter) / inter ** 0.5
    for e in range(num_experts):  # the per-expert loader path (Mixtral's names)
        layer.weight_loader(layer.w13_weight, w13[e, :inter], "w1", e)
        layer.weight_loader(layer.w13_weight, w13[e, inter:], "w3", e)
        layer.weight_loader(layer.w2_weight, w2[e], "w2", e)
    hidden = torch.randn(n, hidden_size)
    logits = torch.randn(n, num_experts) * 2
    logits[:, 5] = -1e4  # expert 5 gets no tokens
    got = layer(hidden, logits)
    torch.testing.assert_close(got, _naive_moe(hidden, logits, w13, w2, top_k, renormalize),
                               atol=1e-5, rtol=1e-5)
    assert layer(hidden[:0], logits[:0]).shape == (0, hidden_size)


def test_fused_experts_follow_the_expert_map():
    """With experts 1, 4 and 6 local (slots 0-2, the others mapped to -1), the output is the
    part of the naive sum that those experts contribute (the hook expert parallelism uses)."""
    torch.manual_seed(1)
    num_experts, hidden_size, inter, n, top_k = 8, 16, 8, 29, 3
    w13 = torch.randn(num_experts, 2 * inter, hidden_size)
    w2 = torch.randn(num_experts, hidden_size, inter)
    hidden, logits = torch.randn(n, hidden_size), torch.randn(n, num_experts)
    local = [1, 4, 6]
    expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
    expert_map[local] = torch.arange(len(local))
    weights, ids = select_experts(logits, top_k, renormalize=True)
    got = fused_experts(hidden, w13[local], w2[local], weights, ids, expert_map, SiluAndMul())
    want = _naive_moe(hidden, logits, w13, w2, top_k, True, local_experts=set(local))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mixtral_softmax_over_topk_logits_equals_renormalised_topk():
    torch.manual_seed(2)
    logits = torch.randn(50, 8) * 3
    weights, ids = select_experts(logits, 2, renormalize=True)
    top_logits, top_ids = torch.topk(logits, 2, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top_logits, -1), atol=1e-6, rtol=0)
    plain, _ = select_experts(logits, 2, renormalize=False)
    assert (plain.sum(-1) < 1).all()


def test_fused_weight_loader_takes_all_experts_at_once():
    torch.manual_seed(3)
    num_experts, hidden_size, inter = 4, 8, 6
    gate_up = torch.randn(num_experts, 2 * inter, hidden_size)
    down = torch.randn(num_experts, hidden_size, inter)
    layer = FusedMoE(num_experts, 2, hidden_size, inter, True)
    layer.weight_loader(layer.w13_weight, gate_up, "w13")
    layer.weight_loader(layer.w2_weight, down, "w2")
    assert torch.equal(layer.w13_weight, gate_up) and torch.equal(layer.w2_weight, down)


@pytest.mark.parametrize("call, message", [
    (lambda m: m.weight_loader(m.w13_weight, torch.zeros(6, 8), "w2", 0), "does not belong"),
    (lambda m: m.weight_loader(m.w13_weight, torch.zeros(6, 8), "gate", 0), "shard id"),
    (lambda m: m.weight_loader(m.w2_weight, torch.zeros(8, 6), "w2", 4), "expert id 4"),
    (lambda m: m.weight_loader(m.w13_weight, torch.zeros(5, 8), "w1", 0), "has 5 along dim 0"),
    # Larger than the config's intermediate size: once narrowed silently to its first rows.
    (lambda m: m.weight_loader(m.w13_weight, torch.zeros(7, 8), "w3", 0), "has 7 along dim 0"),
    (lambda m: m.weight_loader(m.w2_weight, torch.zeros(8, 7), "w2", 0), "has 7 along dim 1"),
    (lambda m: m.weight_loader(m.w13_weight, torch.zeros(6, 9), "w1", 0), "shape mismatch"),
    (lambda m: m.weight_loader(m.w13_weight, torch.zeros(3, 12, 8), "w13"), r"\[4, \.\.\.\]"),
])
def test_weight_loader_errors_name_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call(FusedMoE(4, 2, 8, 6, True))


def test_bad_layer_arguments_are_refused():
    with pytest.raises(ValueError, match="top_k 5"):
        FusedMoE(4, 5, 8, 6, True)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        FusedMoE(4, 2, 8, 6, True, hidden_act="gelu")
