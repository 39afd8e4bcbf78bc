"""DeepSeek-V2 / V3 (MLA over a latent KV cache, DeepSeek MoE routing) and GLM-4 MoE.

Oracles (DESIGN.md §6): HF `transformers` in fp32 on tiny random checkpoints (greedy tokens
equal, logprobs of generated and prompt tokens within 1e-4); the engine against itself (chunked
prefill, prefix caching, batching and preemption change nothing); the MLA forms against each
other and against dense attention; the router against HF's own router modules; the latent
cache's bytes per token against the formula.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.mla_torch import (mla_attention_absorbed,
                                                   mla_attention_expanded)
from pagedllm.layers.mla_attention import MLAAttention
from pagedllm.layers.moe_routing import DeepseekRouting
from pagedllm.models.deepseek_v2 import DeepseekMoE
from pagedllm.models.registry import resolve_model_class
from pagedllm.worker.kv_cache import kv_cache_bytes_per_block
from tests.fixtures.checkpoints import DEFAULT_INITIALIZER_RANGE
from tests.models.test_gemma import (VOCAB_HIGH, VOCAB_LOW, _params, _prompts,
                                     _tokens_and_logprobs, hf_greedy_reference)

LOGPROB_TOL = 1e-4
_MLA: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
                            moe_intermediate_size=32, n_routed_experts=8,
                            max_position_embeddings=1024, rms_norm_eps=1e-6,
                            initializer_range=DEFAULT_INITIALIZER_RANGE,
                            tie_word_embeddings=False)
# name -> (architecture, config class, config overrides, random e_score_correction_bias).
VARIANTS: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    # V2-Lite's shape: no q_lora, softmax greedy top-k, 2 shared experts, a dense first layer,
    # DeepSeek YaRN with mscale != mscale_all_dim (cos/sin and the softmax scale both scaled).
    "v2_lite": ("DeepseekV2ForCausalLM", "DeepseekV2Config",
                dict(_MLA, q_lora_rank=None, num_experts_per_tok=2, n_shared_experts=2,
                     first_k_dense_replace=1, topk_method="greedy",
                     rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                          original_max_position_embeddings=128,
                                          mscale=0.707, mscale_all_dim=1.0,
                                          beta_fast=32, beta_slow=1)), False),
    # V3: q_lora, sigmoid + non-zero bias, 4 groups keep 2, norm_topk_prob, scaling 2.5.
    "v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
           dict(_MLA, q_lora_rank=24, num_experts_per_tok=3, n_shared_experts=1,
                first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                routed_scaling_factor=2.5, rope_interleave=True,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0)), True),
    # GLM-4 MoE: GQA with partial RoPE (0.5), q/k norm, qkv bias, sigmoid routing in 2 groups.
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                 dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=96,
                      moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                      n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                      norm_topk_prob=True, routed_scaling_factor=1.5, use_qk_norm=True,
                      attention_bias=True, max_position_embeddings=1024, rms_norm_eps=1e-6,
                      initializer_range=DEFAULT_INITIALIZER_RANGE, tie_word_embeddings=False),
                 True),
    # V3.2: V3 plus the DSA lightning indexer; index_topk 4 is below every prompt but the
    # first, so most queries attend to 4 of their context tokens (tests/models/test_deepseek_v32.py).
    "v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config",
            dict(_MLA, q_lora_rank=24, num_experts_per_tok=3, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                 routed_scaling_factor=2.5, index_topk=4, index_n_heads=8, index_head_dim=16,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0)), True),
    # V2 with group-limited greedy routing and V2's routed_scaling_factor (slow).
    "v2_group": ("DeepseekV2ForCausalLM", "DeepseekV2Config",
                 dict(_MLA, q_lora_rank=None, num_experts_per_tok=2, n_shared_experts=1,
                      first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4,
                      topk_group=2, routed_scaling_factor=16.0), False),
}


def build_checkpoint(name: str, out_dir: Path, tokenizer_dir: Path,
                     overrides: dict[str, Any] | None = None) -> Path:
    """Save VARIANTS[name] (with `overrides`) with seeded random weights (fp32) and the
    tokenizer; a sigmoid router gets a random non-zero e_score_correction_bias."""
    arch, config_class, kwargs, random_bias = VARIANTS[name]
    out_dir.mkdir(parents=True)
    for path in tokenizer_dir.iterdir():
        if path.is_file():
            shutil.copy(path, out_dir / path.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    config = getattr(transformers, config_class)(
        **{**kwargs, **(overrides or {})}, vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    config.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():   # (V3.2's indexer k_norm: not the identity)
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    if random_bias:
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias)
                                                   * 0.05)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, byte_level_tokenizer_dir):
    """variant -> checkpoint folder, built on first use."""
    root = tmp_path_factory.mktemp("deepseek_checkpoints")
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            paths[name] = build_checkpoint(name, root / name, byte_level_tokenizer_dir)
        return paths[name]

    return get


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", **{"kv_cache_memory_bytes": 8 << 20, **kwargs})


def _model(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.model


def _prompt_logprobs(output) -> list[float]:
    ids = output.prompt_token_ids
    return [step[t].logprob for t, step in zip(ids[1:], output.prompt_logprobs[1:])]


def _assert_close_to_hf(outputs, want) -> None:
    want_tokens, want_logprobs, want_prompt_logprobs = want
    tokens, logprobs = _tokens_and_logprobs(outputs)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])),
                               torch.tensor(sum(want_logprobs, [])), atol=LOGPROB_TOL, rtol=0)
    for output, want_p in zip(outputs, want_prompt_logprobs):
        torch.testing.assert_close(torch.tensor(_prompt_logprobs(output)), torch.tensor(want_p), atol=LOGPROB_TOL,
                                   rtol=0)


# ---------------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("variant", ["v2_lite", "v3", "glm4_moe",
                                     pytest.param("v2_group", marks=pytest.mark.slow)])
def test_greedy_and_logprobs_match_hf_with_chunks_prefix_cache_and_preemption(checkpoints,
                                                                               variant):
    """Chunked prefill (7-token steps, so decode rows run absorbed beside expanded prefill
    chunks) with prefix caching and a KV cache so small that requests are preempted and
    recomputed: HF's greedy tokens and logprobs (within 1e-4)."""
    path = checkpoints(variant)
    llm = _llm(path, kv_cache_memory_bytes=None, num_gpu_blocks_override=12, block_size=8,
               max_model_len=96, enable_prefix_caching=True, max_num_batched_tokens=7,
               max_num_seqs=4)
    # no Llama fused decoder; the native DeepSeek stack (its per-half kernels) may take steps
    assert type(_model(llm).model.layer_stack).__name__ in ("NoneType", "NativeHybridStack")
    if variant != "glm4_moe":
        layers = _model(llm).attention_layers()
        assert all(isinstance(a, MLAAttention) for a in layers)
        assert layers[0].kv_cache.shape == (1, 12, 8, 1, 32 + 8)
    _assert_close_to_hf(llm.generate(_prompts(), _params(prompt_logprobs=True), use_tqdm=False),
                        hf_greedy_reference(path))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["v2_lite", "v3", "glm4_moe", "v2_group"])
def test_greedy_and_logprobs_match_hf(checkpoints, variant):
    """The plain engine (whole prompts in one step, ample cache)."""
    path = checkpoints(variant)
    _assert_close_to_hf(_llm(path).generate(_prompts(), _params(prompt_logprobs=True),
                                            use_tqdm=False), hf_greedy_reference(path))


def test_prefix_caching_batching_and_backend_change_nothing(checkpoints, monkeypatch):
    """Requests served a 32-token shared prefix from the prefix cache, in 11-token steps of up
    to 3 requests (decode rows, absorbed, next to prefill chunks, expanded) on the torch
    reference backend equal one request at a time with no cache on the platform's backend (on
    the CPU with kernels: absorbed decode in the native kernel)."""
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(37)]
    prompts = _prompts()[1::2] + [prefix + [rng.randrange(VOCAB_LOW, VOCAB_HIGH)
                                            for _ in range(n)] for n in (2, 9, 14)]
    path = checkpoints("v3")
    reference = _llm(path, enable_prefix_caching=False)
    alone = [_tokens_and_logprobs(reference.generate([p], _params(), use_tqdm=False))
             for p in prompts]
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "torch_sdpa")
    llm = _llm(path, enable_prefix_caching=True, block_size=8, max_num_batched_tokens=11,
               max_num_seqs=3)
    assert _model(llm).attention_layers()[0].backend.name == "mla_torch"
    outputs = llm.generate(prompts[:3], _params(), use_tqdm=False)
    outputs += [llm.generate(p, _params(), use_tqdm=False)[0] for p in prompts[3:]]
    assert [o.num_cached_tokens for o in outputs[-2:]] == [32, 32]
    tokens, logprobs = _tokens_and_logprobs(outputs)
    assert tokens == [a[0][0] for a in alone]
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])),
                               torch.tensor(sum((a[1][0] for a in alone), [])),
                               atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype, tol", [
    ("int8", 0.2), pytest.param("fp8_e4m3", 0.4, marks=pytest.mark.slow)])
def test_quantized_latent_cache_stays_close(checkpoints, kv_cache_dtype, tol):
    """An int8 / fp8 latent cache (scales after the data, kv_cache_layout.py): one byte per
    value, and prompt logprobs (the prefill reads its latents back from the cache) near the
    float32 cache's, relative to the largest |logprob| (tests/worker's bound for Llama's K/V
    is 0.05 / 0.3). NOTE(mla): one int8 scale covers a token's whole latent, c_kv and k_pe
    together (they differ in range: ~2.5 vs ~7 here), and a random tiny MoE flips experts on
    small changes; measured 0.11 (int8) and 0.23 (fp8) of the largest |logprob|, see
    docs/mla.md."""
    path = checkpoints("v2_lite")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    base = [_prompt_logprobs(o) for o in _llm(path).generate(_prompts(), params,
                                                             use_tqdm=False)]
    llm = _llm(path, kv_cache_dtype=kv_cache_dtype)
    layers = _model(llm).attention_layers()
    assert layers[0].kv_cache.element_size() == 1
    got = [_prompt_logprobs(o) for o in llm.generate(_prompts(), params, use_tqdm=False)]
    base_t = torch.tensor(sum(base, []))
    diff = (torch.tensor(sum(got, [])) - base_t).abs()
    assert 0 < diff.max() < tol * base_t.abs().max()


def test_unknown_topk_method_fails_at_load_naming_the_field(checkpoints, tmp_path,
                                                            byte_level_tokenizer_dir):
    path = build_checkpoint("v2_lite", tmp_path / "bad", byte_level_tokenizer_dir)
    config = transformers.AutoConfig.from_pretrained(path)
    config.topk_method = "best_guess"
    config.save_pretrained(path)
    with pytest.raises(ValueError, match="topk_method 'best_guess'"):
        _llm(path)
    config.topk_method = "greedy"
    config.scoring_func = "sigmoid"
    config.save_pretrained(path)
    with pytest.raises(ValueError, match="scoring_func 'sigmoid'"):
        _llm(path)


# ---------------------------------------------------------------------------------- KV cache

def test_latent_cache_bytes_per_token_equal_the_formula():
    """A latent layer holds kv_lora_rank + qk_rope_head_dim values per token; per-head K/V of
    the same model (DeepSeek-V2-Lite: 27 layers, 16 heads of 192-value keys and 128-value
    values) would need H * (dn + dr + dv) values: at least 5x the bytes per token (8.9x)."""
    block_size, num_layers = 16, 27
    kv_lora_rank, rope, heads, qk_head, v_head = 512, 64, 16, 192, 128
    layers = [MLAAttention(heads, kv_lora_rank, rope, qk_head ** -0.5, f"layer{i}")
              for i in range(num_layers)]
    for dtype, elem in ((torch.bfloat16, 2), (torch.float32, 4)):
        per_token = kv_cache_bytes_per_block(layers, block_size, dtype) // block_size
        assert per_token == num_layers * (kv_lora_rank + rope) * elem
        per_head_kv = num_layers * heads * (qk_head + v_head) * elem
        assert per_head_kv >= 5 * per_token
    # int8: one byte per value and a 4-byte scale per token and layer.
    per_token = kv_cache_bytes_per_block(layers, block_size, torch.int8) // block_size
    assert per_token == num_layers * (kv_lora_rank + rope + 4)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_engine_sizes_the_cache_by_latent_bytes(checkpoints):
    """The budget buys blocks at the latent's bytes per block, and the start-up log reports the
    bytes per token with the formula."""
    handler, log = _Records(), logging.getLogger("pagedllm.worker.worker")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        llm = _llm(checkpoints("v2_lite"), kv_cache_memory_bytes=1 << 20, block_size=16)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert any("480 bytes per token = 3 MLA layers x (32 + 8 latent values x 4 bytes)" in m
               for m in handler.messages)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    bytes_per_block = runner.kv_cache_bytes_per_block()
    assert bytes_per_block == 3 * (32 + 8) * 4 * 16
    num_blocks = runner.model.attention_layers()[0].kv_cache.shape[1]
    assert num_blocks == (1 << 20) // bytes_per_block


# ---------------------------------------------------------------------------------- the ops

def test_absorbed_and_expanded_forms_equal_dense_attention():
    """Both MLA forms equal per-head attention with keys [W_UK c | k_pe] and values W_UV c,
    for several query tokens per request (causal) and padded context."""
    torch.manual_seed(0)
    g, q_len, s, heads, dn, dr, dv, rank = 3, 4, 9, 4, 8, 4, 6, 10
    q_nope, q_pe = torch.randn(g, q_len, heads, dn), torch.randn(g, q_len, heads, dr)
    latent = torch.randn(g, s, rank + dr)
    w = torch.randn(heads, dn + dv, rank) / rank ** 0.5
    seq_lens = torch.tensor([9, 6, 4])
    q_pos = seq_lens[:, None] - q_len + torch.arange(q_len)
    mask = (torch.arange(s)[None, None, :] <= q_pos[:, :, None])[:, None]
    scale = 0.3
    k = torch.cat((torch.einsum("gsl,hdl->gshd", latent[..., :rank], w[:, :dn]),
                   latent[:, :, None, rank:].expand(-1, -1, heads, -1)), dim=-1)
    v = torch.einsum("gsl,hdl->gshd", latent[..., :rank], w[:, dn:])
    scores = torch.einsum("gqhd,gshd->ghqs", torch.cat((q_nope, q_pe), -1), k) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    want = torch.einsum("ghqs,gshd->gqhd", probs, v)
    for form in (mla_attention_expanded, mla_attention_absorbed):
        torch.testing.assert_close(form(q_nope, q_pe, latent, w, mask, scale), want,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["v2_group", "v3"])
def test_router_matches_hf(variant):
    """`DeepseekMoE`'s routing equals HF's router module (ids as sets, weights per id)."""
    arch, config_class, kwargs, random_bias = VARIANTS[variant]
    config = getattr(transformers, config_class)(**kwargs, vocab_size=64)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(config).model.layers[1].mlp.gate
    with torch.no_grad():
        hf.weight.normal_()
        if random_bias:
            hf.e_score_correction_bias.normal_()
    block = DeepseekMoE(config, resolve_model_class([arch]).routing(config), "silu")
    block.gate.weight.data.copy_(hf.weight)
    if random_bias:
        block.gate.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
    x = torch.randn(50, config.hidden_size)
    _, want_w, want_ids = hf(x)
    got_w, got_ids = block.routing.select_experts(block.gate(x),
                                                  block.gate.e_score_correction_bias)
    for i in range(x.shape[0]):
        want = dict(zip(want_ids[i].tolist(), want_w[i].tolist()))
        got = dict(zip(got_ids[i].tolist(), got_w[i].tolist()))
        assert got.keys() == want.keys()
        torch.testing.assert_close(torch.tensor([got[e] for e in want]),
                                   torch.tensor(list(want.values())))


def test_routing_rejects_bad_settings():
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        DeepseekRouting(8, 2, "softmax", "noaux_tc")
    with pytest.raises(ValueError, match="scoring_func 'tanh'"):
        DeepseekRouting(8, 2, "tanh", "greedy")
    with pytest.raises(ValueError, match="n_group 3"):
        DeepseekRouting(8, 2, "sigmoid", "noaux_tc", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="topk_group 5"):
        DeepseekRouting(8, 2, "softmax", "group_limited_greedy", n_group=4, topk_group=5)


# ---------------------------------------------------------------------------------- parallel

_PARALLEL_PARAMS = [SamplingParams(max_tokens=10, temperature=0.0)]


@pytest.mark.slow
def test_eplb_rebalancing_mid_run_changes_no_token(checkpoints):
    """DeepSeek routing through the expert map: one process with 2 redundant experts and a
    rebalance every 3 steps (experts change slots mid-run); same greedy tokens as without."""
    from tests.distributed.common import run
    path = checkpoints("v3")
    eplb = dict(enable_expert_parallel=True, enable_eplb=True,
                eplb_config={"window_size": 8, "step_interval": 3, "num_redundant_experts": 2})
    assert run(path, _PARALLEL_PARAMS, **eplb) == run(path, _PARALLEL_PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("variant, parallel", [
    ("v2_lite", dict(tensor_parallel_size=2)),
    ("v3", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("glm4_moe", dict(tensor_parallel_size=2)),
    ("v3", dict(pipeline_parallel_size=2)),
    ("v32", dict(tensor_parallel_size=2)),
    ("v32", dict(pipeline_parallel_size=2)),
])
def test_parallel_matches_single_process(checkpoints, variant, parallel):
    """tp=2 (two worker processes, gloo): MLA heads split, q_a / kv_a projections and the latent
    cache replicated; experts sharded (or whole per rank with EP). pp=2: the 3 layers (one dense,
    two MoE) split over two stages. V3.2: the indexer and its cache replicated too, each rank
    selecting the same tokens for its heads. Same greedy tokens."""
    from tests.distributed.common import run
    path = checkpoints(variant)
    assert (run(path, _PARALLEL_PARAMS, distributed_executor_backend="mp", **parallel)
            == run(path, _PARALLEL_PARAMS))
