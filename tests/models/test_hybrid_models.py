"""Hybrid / state-space models end to end against HF `transformers` (greedy) on tiny random
checkpoints: Mamba-2 (SSD mixers only), LFM2 (short convolutions + attention layers),
Qwen3-Next (Gated DeltaNet + gated attention, MoE with a shared expert and a dense layer) and
Qwen3.5's text model (its Gated DeltaNet projections, dense MLPs), Granite 4 hybrid (Mamba-2
+ attention layers, MoE + shared MLP, Granite's multipliers) and Falcon-H1 (a Mamba-2 mixer and
attention side by side in every layer, muP multipliers, the gated norm before the gate).

One engine per configuration serves prompts of different lengths together (mixed prefill and
decode steps): the default, chunked prefill with a token budget that splits the scan's chunks
(chunk_size 8, budget 13), preemption (a KV / token-slot budget far below the batch), and prefix
caching off. The engine runs in float32; its tokens must equal HF's greedy decoding and its
chosen-token logprobs agree within 1e-4 (or HF's own float32 error: see `hf_references`). Prefix
caching is mode "align" (the default): a repeated batch hits at each prompt's last block
boundary and gives the same tokens (tests/models/test_hybrid_prefix_caching.py: partial
prefixes, mode "none", the server's usage).
"""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from tests.fixtures.checkpoints import make_tiny_checkpoint

MODELS = {
    "mamba2": ("Mamba2ForCausalLM", dict(
        num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, chunk_size=8,
        conv_kernel=4, layer_norm_epsilon=1e-5, time_step_min=0.01, time_step_max=0.1)),
    "lfm2": ("Lfm2ForCausalLM", dict(
        layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, conv_L_cache=3,
        norm_eps=1e-5, block_auto_adjust_ff_dim=False)),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_hidden_layers=3, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True,
        seed=1)),
    "qwen3_5": ("Qwen3_5ForCausalLM", dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_hidden_layers=3, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)),
    "granite_hybrid": ("GraniteMoeHybridForCausalLM", dict(
        layer_types=["linear_attention", "attention", "linear_attention"], num_hidden_layers=3,
        mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_n_groups=2, mamba_d_state=16,
        mamba_chunk_size=8, mamba_d_conv=4, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, shared_intermediate_size=48, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
        logits_scaling=2.0)),
    "falcon_h1": ("FalconH1ForCausalLM", dict(
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128,
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True,
        lm_head_multiplier=0.5, embedding_multiplier=2.0, mlp_multipliers=[0.7, 1.3],
        key_multiplier=0.8, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], ssm_in_multiplier=0.95,
        ssm_out_multiplier=1.2)),
    # Falcon-H1's defaults for the mixer's output: no gated norm, y * silu(z).
    "falcon_h1_no_norm": ("FalconH1ForCausalLM", dict(
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128,
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=8, mamba_rms_norm=False, ssm_in_multiplier=0.95)),
}
# The longest first: it fills the "preempt" cache. 70 tokens: two of the delta rule's 64-token
# scan chunks (Mamba-2's chunk here is 8).
PROMPT_LENGTHS = (70, 40, 5, 1, 19)
MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
# name -> LLM keyword arguments (block_size 16; the scan's chunk is 8 tokens).
CONFIGS = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=13),
    "preempt": dict(block_size=4, num_gpu_blocks_override=21, max_num_batched_tokens=64),
    "no_prefix_caching": dict(enable_prefix_caching=False, max_num_seqs=2),
}


class _Lazy(dict):
    """name -> value, computed by `make(name)` on first access."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, name: str):
        self[name] = self._make(name)
        return self[name]


@pytest.fixture(scope="module")
def hybrid_checkpoints(tmp_path_factory, byte_level_tokenizer_dir):
    root = tmp_path_factory.mktemp("hybrid")
    return _Lazy(lambda name: make_tiny_checkpoint(root / name, MODELS[name][0],
                                                   byte_level_tokenizer_dir, **MODELS[name][1]))


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in PROMPT_LENGTHS]


def _hf_greedy(path, name: str, dtype: torch.dtype) -> list[tuple[list[int], list[float]]]:
    """[(tokens, logprobs)] of HF greedy decoding of each prompt in `dtype`: a prefill with HF's
    cache, then one token per forward (what `generate` does, without its ~2 s of overhead per
    call on this machine)."""
    extra = ({"experts_implementation": "eager"} if name in ("qwen3_next", "granite_hybrid")
             else {})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    refs = []
    for prompt in _prompts():
        tokens, logprobs = [], []
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), use_cache=True)
            for i in range(MAX_TOKENS):
                lp = torch.log_softmax(out.logits[0, -1].double(), -1)
                tokens.append(int(lp.argmax()))
                logprobs.append(lp[tokens[-1]].item())
                if i + 1 < MAX_TOKENS:
                    out = hf(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True,
                             position_ids=torch.tensor([[len(prompt) + i]]))
        refs.append((tokens, logprobs))
    return refs


@pytest.fixture(scope="module")
def hf_references(hybrid_checkpoints):
    """model name -> [(tokens, logprobs, tolerances)] per prompt.

    NOTE(hybrid tests): the reference is HF in float64, and the bound on a step's logprob is
    1e-4 or twice HF's own float32 error there, whichever is larger. Random Qwen3-Next
    checkpoints have a few ill-conditioned steps where float32 rounding alone moves the
    logprob past 1e-4: on this one, the 19-token prompt's first token is 3e-4 off in HF's
    float32 path and 2e-4 in the engine's (1e-5 at the other steps, where both stay < 1e-4).
    HF float32 greedy tokens equal the float64 ones (asserted)."""
    def make(name: str) -> list:
        path = hybrid_checkpoints[name]
        refs = []
        for (tokens, lps), (tokens32, lps32) in zip(_hf_greedy(path, name, torch.float64),
                                                    _hf_greedy(path, name, torch.float32)):
            assert tokens32 == tokens
            refs.append((tokens, lps, [max(LOGPROB_TOL, 2 * abs(a - b))
                                       for a, b in zip(lps, lps32)]))
        return refs

    return _Lazy(make)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _check(outs, refs) -> None:
    for prompt, out, (want, want_lp, tol) in zip(_prompts(), outs, refs):
        completion = out.outputs[0]
        assert list(completion.token_ids) == want, f"prompt of {len(prompt)} tokens"
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        errors = [abs(a - b) for a, b in zip(got, want_lp)]
        assert all(e <= t for e, t in zip(errors, tol)), (len(prompt), errors, tol)


# The default run: Mamba-2 and Qwen3-Next with the default and chunked configurations, LFM2
# (attention and state groups) with all, Qwen3.5 and Granite chunked; the rest is `slow`.
DEFAULT_CASES = {("mamba2", "default"), ("mamba2", "chunked"), ("qwen3_next", "default"),
                 ("qwen3_next", "chunked"), ("qwen3_5", "chunked"),
                 ("granite_hybrid", "chunked"), ("falcon_h1", "chunked")} | {
                     ("lfm2", config) for config in CONFIGS}
CASES = [pytest.param(model, config, marks=() if (model, config) in DEFAULT_CASES
                      else pytest.mark.slow)
         for model in MODELS for config in CONFIGS]


@pytest.mark.parametrize("model,config", CASES)
def test_greedy_matches_hf(hybrid_checkpoints, hf_references, model, config):
    llm = LLM(str(hybrid_checkpoints[model]), dtype="float32", kv_cache_memory_bytes=8 << 20,
              **CONFIGS[config])
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    _check(llm.generate(prompts, _greedy(), use_tqdm=False), hf_references[model])
    stats = llm.get_stats()
    if config == "preempt":
        assert stats.num_preemptions > 0
    if config in ("default", "chunked"):
        # Prefix caching mode "align": the same prompts again hit at their last block
        # boundary (block_size 16: 64 of 70 tokens, 32 of 40, 16 of 19) and give the same
        # tokens.
        again = llm.generate(prompts, _greedy(), use_tqdm=False)
        assert [o.num_cached_tokens for o in again] == [
            n - n % 16 if n % 16 else n - 16 for n in PROMPT_LENGTHS]
        _check(again, hf_references[model])
    if config == "preempt":
        # The cache keeps the blocks of the prompts that finished last (block_size 4): the
        # 19-token one hits 16 tokens, then its batch preempts and resumes again.
        again = llm.generate(prompts[::-1], _greedy(), use_tqdm=False)
        assert again[0].num_cached_tokens == 16
        _check(again[::-1], hf_references[model])
    scheduler = llm.llm_engine.engine_core.scheduler
    assert all(not g.req_to_blocks for g in scheduler.kv_cache_manager.groups)


def test_state_memory_in_startup_log(hybrid_checkpoints, caplog):
    with caplog.at_level("INFO", logger="pagedllm"):
        LLM(str(hybrid_checkpoints["lfm2"]), dtype="float32", kv_cache_memory_bytes=4 << 20,
            max_num_seqs=4)
    # Two conv layers of a [64, 2] float32 window: 1 KiB per request; mode "align" doubles
    # the slots (steps that cross a block boundary, checkpoints).
    assert ("8 state slots (one per running request, and as many for steps that cross a block "
            "and for prefix-cache checkpoints: mamba_cache_mode align) of 0.001 MiB state "
            "memory per request (0.008 MiB in all)") in caplog.text


def test_too_long_prompt_is_refused_alone(hybrid_checkpoints, hf_references):
    llm = LLM(str(hybrid_checkpoints["lfm2"]), dtype="float32", num_gpu_blocks_override=6)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("long", {"prompt_token_ids": [5] * 90}, _greedy())
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _greedy(),
                        use_tqdm=False)
    _check(outs, hf_references["lfm2"])


def test_a_budget_too_small_for_the_state_cache_names_the_minimum(hybrid_checkpoints):
    """The refusal says how many bytes two blocks take with the state slots of max_num_seqs
    requests, and that budget is enough to start."""
    with pytest.raises(ValueError, match=r"at least 2 are needed: \d+ bytes with this model's "
                       r"cache groups, the state cache's slots for max_num_seqs=128") as error:
        LLM(str(hybrid_checkpoints["qwen3_next"]), dtype="float32", kv_cache_memory_bytes=64 << 10)
    need = int(re.search(r"needed: (\d+) bytes", str(error.value)).group(1))
    LLM(str(hybrid_checkpoints["qwen3_next"]), dtype="float32", kv_cache_memory_bytes=need)


def test_unsupported_layer_type_fails_at_load(hybrid_checkpoints, tmp_path):
    path = tmp_path / "lfm2_sliding"
    shutil.copytree(hybrid_checkpoints["lfm2"], path)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["conv", "sliding_attention", "conv"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_attention"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)


def test_speculative_decoding_is_refused(hybrid_checkpoints):
    with pytest.raises(ValueError, match="cannot be rolled back"):
        LLM(str(hybrid_checkpoints["mamba2"]), dtype="float32", kv_cache_memory_bytes=4 << 20,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("options", [dict(async_scheduling=True),
                                     pytest.param(dict(num_scheduler_steps=1, max_num_seqs=3),
                                                  marks=pytest.mark.slow)])
def test_async_and_single_steps_match_hf(hybrid_checkpoints, hf_references, options):
    """Asynchronous scheduling (an output placeholder per step, inputs filled on the device)
    and single steps (no multi-step rounds) leave the states as the default engine does."""
    llm = LLM(str(hybrid_checkpoints["lfm2"]), dtype="float32", kv_cache_memory_bytes=4 << 20,
              **options)
    _check(llm.generate([{"prompt_token_ids": p} for p in _prompts()], _greedy(),
                        use_tqdm=False), hf_references["lfm2"])
