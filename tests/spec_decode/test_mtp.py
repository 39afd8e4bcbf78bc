"""MTP speculative decoding on a tiny DeepSeek-V3 checkpoint whose MTP module (random, in
vLLM's layout `model.layers.{L}.*`) is written next to the transformers weights (transformers
drops MTP weights, so it cannot build them): greedy outputs equal the engine without
speculation (chunked prefill, prefix caching and preemption on), acceptance counters are
reported, and models without MTP layers are refused at start naming the problem."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from tests.models.test_deepseek import VARIANTS, _Records, build_checkpoint
from tests.models.test_gemma import _params, _prompts

MTP = {"method": "mtp", "num_speculative_tokens": 2}


def add_mtp_tensors(path: Path, seed: int = 1, num_modules: int = 1) -> None:
    """Append `num_modules` random MTP modules (`model.layers.{num_hidden_layers + j}.*`,
    module j seeded `seed + j`, per-expert tensors as released DeepSeek-V3 checkpoints hold
    them) to the checkpoint's safetensors file."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    for j in range(num_modules):
        tensors.update(_mtp_module(tensors, j, seed + j))
    save_file(tensors, str(file), metadata={"format": "pt"})


def _mtp_module(target: dict[str, torch.Tensor], j: int, seed: int) -> dict[str, torch.Tensor]:
    _, _, cfg, _ = VARIANTS["v3"]
    h, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["moe_intermediate_size"]
    q_lora, kv_lora = 24, cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    def norm(n):
        return 1 + r(n)

    p = f"model.layers.{cfg['num_hidden_layers'] + j}."
    t = {"enorm.weight": norm(h), "hnorm.weight": norm(h), "eh_proj.weight": r(h, 2 * h),
         "shared_head.norm.weight": norm(h),
         "input_layernorm.weight": norm(h), "post_attention_layernorm.weight": norm(h),
         "self_attn.q_a_proj.weight": r(q_lora, h), "self_attn.q_a_layernorm.weight": norm(q_lora),
         "self_attn.q_b_proj.weight": r(heads * (dn + dr), q_lora),
         "self_attn.kv_a_proj_with_mqa.weight": r(kv_lora + dr, h),
         "self_attn.kv_a_layernorm.weight": norm(kv_lora),
         "self_attn.kv_b_proj.weight": r(heads * (dn + dv), kv_lora),
         "self_attn.o_proj.weight": r(h, heads * dv),
         "mlp.gate.weight": r(cfg["n_routed_experts"], h),
         "mlp.gate.e_score_correction_bias": r(cfg["n_routed_experts"]),
         "mlp.shared_experts.gate_proj.weight": r(inter, h),
         "mlp.shared_experts.up_proj.weight": r(inter, h),
         "mlp.shared_experts.down_proj.weight": r(h, inter)}
    for e in range(cfg["n_routed_experts"]):
        t.update({f"mlp.experts.{e}.gate_proj.weight": r(inter, h),
                  f"mlp.experts.{e}.up_proj.weight": r(inter, h),
                  f"mlp.experts.{e}.down_proj.weight": r(h, inter)})
    # The copies of the target's embedding and head that released checkpoints carry (unused).
    t["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    t["shared_head.head.weight"] = target["lm_head.weight"].clone()
    return {p + k: v.contiguous() for k, v in t.items()}


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory, byte_level_tokenizer_dir) -> Path:
    path = build_checkpoint("v3", tmp_path_factory.mktemp("mtp") / "v3_mtp",
                            byte_level_tokenizer_dir, {"num_nextn_predict_layers": 1})
    add_mtp_tensors(path)
    return path


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", **{"kv_cache_memory_bytes": 8 << 20, **kwargs})


def test_mtp_greedy_identical_with_chunks_prefix_cache_and_preemption(mtp_checkpoint):
    """One engine with MTP (k = 2), 7-token chunks, prefix caching and a cache small enough
    to preempt: the same greedy tokens as the plain engine, drafts counted per position."""
    prompts = _prompts()
    prompts = prompts + [prompts[0][:10] + prompts[1][:5]]   # shares a cached prefix
    want = [list(o.outputs[0].token_ids)
            for o in _llm(mtp_checkpoint).generate(prompts, _params(), use_tqdm=False)]
    llm = _llm(mtp_checkpoint, kv_cache_memory_bytes=None, num_gpu_blocks_override=10,
               block_size=8, max_model_len=96, enable_prefix_caching=True,
               max_num_batched_tokens=7, max_num_seqs=4, speculative_config=MTP)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert type(runner.drafter.model).__name__ == "MtpHead"
    # The MTP layer's MLA attention has a latent cache of its own, beside the target's 3.
    layers = runner._attention_layers()
    assert len(layers) == 4 and layers[-1].kv_cache is not layers[0].kv_cache
    got = [list(o.outputs[0].token_ids)
           for o in llm.generate(prompts, _params(), use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    stats = llm.get_stats().spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens <= 2 * stats.num_drafts
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) <= 2 and sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))


def test_mtp_on_a_model_without_mtp_layers_fails_at_start(tmp_path, byte_level_tokenizer_dir):
    path = build_checkpoint("v3", tmp_path / "plain", byte_level_tokenizer_dir,
                            {"num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        _llm(path, speculative_config=MTP)
    # transformers' V3 config says 1 by default but saves no MTP tensors: named at load.
    path = build_checkpoint("v3", tmp_path / "no_tensors", byte_level_tokenizer_dir)
    with pytest.raises(Exception,
                       match=r"lacks MTP weights of module\(s\) model\.layers\.3\.\*"):
        _llm(path, speculative_config=MTP)


@pytest.fixture(scope="module")
def two_module_checkpoint(tmp_path_factory, byte_level_tokenizer_dir) -> Path:
    """A tiny V3 checkpoint whose config says num_nextn_predict_layers = 2, with two random
    MTP modules (model.layers.3.* and model.layers.4.*, different seeds)."""
    path = build_checkpoint("v3", tmp_path_factory.mktemp("mtp2") / "v3_mtp2",
                            byte_level_tokenizer_dir, {"num_nextn_predict_layers": 2})
    add_mtp_tensors(path, num_modules=2)
    return path


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, _params(), use_tqdm=False)]


def _mtp_engine(path: Path, k: int):
    """An MTP engine (k drafts) and its two MTP modules' latent caches, zeroed."""
    llm = _llm(path, speculative_config={**MTP, "num_speculative_tokens": k})
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    caches = [a.kv_cache for a in runner._attention_layers()[-2:]]
    for cache in caches:
        cache.zero_()
    return llm, runner.drafter.model, caches


def test_two_mtp_modules_load_and_cycle_by_draft_step(two_module_checkpoint):
    """Both modules load with their own weights and latent caches (3 target layers + 2);
    draft step i runs module i % 2 (vLLM's rule): with k = 1 only module 0 ever runs, so
    module 1's cache stays untouched; with k = 2 module 1 drafts the second token and writes
    its cache. Greedy tokens equal the engine without MTP either way."""
    prompts = _prompts()
    want = _greedy(_llm(two_module_checkpoint), prompts)
    weights = load_file(str(two_module_checkpoint / "model.safetensors"))
    for k, module_1_runs in ((1, False), (2, True)):
        handler, log = _Records(), logging.getLogger("pagedllm.worker.worker")
        log.addHandler(handler)
        old_level = log.level
        log.setLevel(logging.INFO)
        try:
            llm, head, caches = _mtp_engine(two_module_checkpoint, k)
        finally:
            log.removeHandler(handler)
            log.setLevel(old_level)
        # The start-up log's bytes per token count the MTP modules' latent caches too.
        assert any("800 bytes per token = 5 MLA layers x (32 + 8 latent values x 4 bytes)" in m
                   for m in handler.messages)
        assert len(head.layers) == 2 and caches[0] is not caches[1]
        for j in range(2):
            torch.testing.assert_close(head.layers[j].eh_proj.weight,
                                       weights[f"model.layers.{3 + j}.eh_proj.weight"])
        assert _greedy(llm, prompts) == want
        assert bool(caches[0].any())
        assert bool(caches[1].any()) == module_1_runs
        stats = llm.get_stats().spec_decoding_stats
        assert stats.num_drafts > 0 and len(stats.num_accepted_tokens_per_pos) <= k


def test_config_claiming_more_mtp_modules_than_shipped_fails_naming_them(
        two_module_checkpoint, tmp_path):
    """num_nextn_predict_layers = 3 over a checkpoint that ships modules 3 and 4 only: the
    load fails naming module model.layers.5.* and its tensors."""
    path = tmp_path / "claims_3"
    shutil.copytree(two_module_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 3}))
    with pytest.raises(Exception, match=r"module\(s\) model\.layers\.5\.\* \(its config says "
                                        r"num_nextn_predict_layers = 3.*model\.layers\.5\.eh_proj"):
        _llm(path, speculative_config=MTP)


@pytest.mark.slow
def test_two_mtp_modules_greedy_identical_for_k_1_2_3(two_module_checkpoint):
    """k = 1, 2, 3 over two MTP modules (k = 3 runs modules 0, 1, 0): greedy tokens equal the
    engine without MTP; prints the acceptance per draft position."""
    prompts = _prompts()
    want = _greedy(_llm(two_module_checkpoint), prompts)
    for k in (1, 2, 3):
        llm = _llm(two_module_checkpoint, speculative_config={**MTP, "num_speculative_tokens": k})
        assert _greedy(llm, prompts) == want
        stats = llm.get_stats().spec_decoding_stats
        print(f"k={k}: accepted {stats.num_accepted_tokens} of {stats.num_draft_tokens} draft "
              f"tokens, per position {stats.num_accepted_tokens_per_pos}")


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_drafts_equal_the_mtp_module_run_by_transformers(mtp_checkpoint):
    """The engine's k drafts after the prefill step equal the MTP module (tech report sec.
    2.2) computed without a KV cache: HF's final hidden states of the target, enorm / hnorm /
    eh_proj in plain torch, the MTP decoder layer as HF's own `DeepseekV3DecoderLayer` holding
    the checkpoint's MTP tensors, shared_head.norm and HF's LM head; each draft step appends
    the layer's pre-norm output as the next hidden state (the oracle of the plumbing, the
    token shift, the weights' layout and the MTP layer's own latent KV cache)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    k = 3
    hf = AutoModelForCausalLM.from_pretrained(mtp_checkpoint, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    num_layers = hf.config.num_hidden_layers
    p = f"model.layers.{num_layers}."
    t = {n[len(p):]: v for n, v in load_file(str(mtp_checkpoint / "model.safetensors")).items()
         if n.startswith(p)}
    layer = DeepseekV3DecoderLayer(hf.config, num_layers).eval()
    experts = hf.config.n_routed_experts
    state = {n: v for n, v in t.items() if n.startswith(("self_attn.", "input_layernorm",
                                                         "post_attention", "mlp.gate",
                                                         "mlp.shared_experts"))}
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [t[f"mlp.experts.{e}.gate_proj.weight"], t[f"mlp.experts.{e}.up_proj.weight"]])
        for e in range(experts)])
    state["mlp.experts.down_proj"] = torch.stack([t[f"mlp.experts.{e}.down_proj.weight"]
                                                  for e in range(experts)])
    layer.load_state_dict(state, strict=True)

    prompt = _prompts()[2]
    llm = _llm(mtp_checkpoint, speculative_config={**MTP, "num_speculative_tokens": k})
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, _params())
    engine.step()
    request = engine.engine_core.scheduler.requests["r"]
    drafts, first = list(request.spec_token_ids), request.output_token_ids[0]
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        assert int(hf.lm_head(hidden[-1]).argmax()) == first
        tokens = prompt[1:] + [first]
        want = []
        for _ in range(k):
            n = len(tokens)
            embed = hf.model.embed_tokens(torch.tensor(tokens))
            embed[0] = 0    # position 0 (vLLM masks it)
            h = torch.cat([_rms(embed, t["enorm.weight"]), _rms(hidden, t["hnorm.weight"])],
                          -1) @ t["eh_proj.weight"].T
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(h[None], attention_mask=mask, position_ids=positions,
                        position_embeddings=hf.model.rotary_emb(h[None], positions))
            out = (out[0] if isinstance(out, tuple) else out)[0]
            want.append(int(hf.lm_head(_rms(out[-1], t["shared_head.norm.weight"])).argmax()))
            tokens = tokens + [want[-1]]
            hidden = torch.cat([hidden, out[-1:]], 0)
    assert len(drafts) == k and drafts == want


@pytest.mark.slow
def test_mtp_under_tensor_parallelism_matches_single_process(mtp_checkpoint):
    """tp=2 (two worker processes, gloo) with MTP: the head's MLA heads and experts are split
    as the target's; the same greedy tokens as one process without speculation."""
    from tests.distributed.common import run
    params = [SamplingParams(max_tokens=10, temperature=0.0)]
    assert (run(mtp_checkpoint, params, distributed_executor_backend="mp",
                tensor_parallel_size=2, speculative_config=MTP)
            == run(mtp_checkpoint, params))
