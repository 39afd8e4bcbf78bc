"""LoRA on MoE families with shared experts and dense layers among the sparse ones, against
`transformers` + `peft` (fp32, greedy) on tiny random checkpoints: Qwen2-MoE (a shared expert
with its sigmoid gate, a dense layer by `mlp_only_layers`) and DeepSeek-V3 (MLA with q_lora,
shared experts, a dense first layer) by default; Qwen3-MoE, GLM-4 MoE and DeepSeek-V2-Lite (MLA
without q_lora) in the slow run. Each adapter is made by `peft` on the dense MLPs, the shared
experts (and Qwen2-MoE's shared-expert gate), the attention's projections (MLA: q_a / q_b /
kv_a_proj_with_mqa / o_proj) and the routed experts' 3-D parameters; one mixed batch (base rows
and two adapters, chunked prefill) gives every request the tokens of its adapter under HF +
PEFT, logprobs within the MoE tests' tolerance.

NOTE(peft): on transformers 5, PEFT rewrites the target modules gate_proj / up_proj / down_proj
of the DeepSeek-family models (DeepSeek-V2/V3, GLM-4 MoE) into the experts' 3-D parameters (with
`rank_pattern` / `alpha_pattern` doubling the fused gate_up's rank and alpha), so it cannot put
an adapter on their dense MLPs or shared experts. For those families the adapters get random
tensors for those modules beside PEFT's own (the layout PEFT writes for any linear module), and
the oracle is HF with those deltas merged into its weights (W + scaling B A) under PEFT.

An adapter on MLA's kv_b_proj, or with expert tensors on a dense layer, is refused naming the
reason while the engine goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM, LoRARequest
from pagedllm.lora.peft import LoRAModelShapes, load_peft_adapter
from tests.lora.adapters import make_peft_adapter
from tests.lora.test_lora_moe import (LOGPROB_TOL, PARAMS, _prompts,
                                      _tokens_and_logprobs, assert_tp2_equals_one_process,
                                      hf_greedy_with_logprobs)
from tests.models.test_deepseek import build_checkpoint
from tests.models.test_moe import _build

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# variant -> (checkpoint builder, adapter "a" targets, adapter "b" targets); "a" is rank 8 on
# the attention, every MLP linear and all expert parameters, "b" rank 4 with rsLoRA on o_proj,
# the down projections and the experts' gate_up only.
VARIANTS = {
    "qwen2_moe": (_build, ["q_proj", "v_proj", *MLP, "shared_expert_gate"],
                  ["o_proj", "down_proj"]),
    "v3": (build_checkpoint, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", *MLP],
           ["o_proj", "down_proj"]),
    "qwen3_moe": (_build, ["k_proj", *MLP], ["o_proj", "down_proj"]),
    "glm4_moe": (build_checkpoint, ["q_proj", "v_proj", *MLP], ["o_proj", "down_proj"]),
    "v2_lite": (build_checkpoint, ["q_proj", "kv_a_proj_with_mqa", *MLP], ["o_proj", "down_proj"]),
}
SLOW = pytest.mark.slow
# Families whose dense MLPs and shared experts PEFT cannot target on transformers 5.
PEFT_CONVERTED = ("v3", "glm4_moe", "v2_lite")


def _add_mlp_tensors(peft_dir: Path, out: Path, shapes: LoRAModelShapes, seed: int
                     ) -> dict[str, torch.Tensor]:
    """Copy the PEFT adapter at `peft_dir` to `out` with random rank-r tensors added for every
    dense-MLP and shared-expert projection it lacks; returns module path -> its merged delta
    W [out, in] (scaling lora_alpha / r, as PEFT's)."""
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    rank, scaling = config["r"], config["lora_alpha"] / config["r"]
    generator = torch.Generator().manual_seed(seed)
    deltas = {}
    for layer in range(shapes.num_layers):
        for module, (in_features, out_features) in shapes.layer_features[layer].items():
            path = f"model.layers.{layer}.mlp.{module}"
            if f"base_model.model.{path}.lora_A.weight" in tensors:
                continue
            a = torch.randn(rank, in_features, generator=generator) * in_features ** -0.5
            b = torch.randn(out_features, rank, generator=generator) * 0.2
            tensors[f"base_model.model.{path}.lora_A.weight"] = a
            tensors[f"base_model.model.{path}.lora_B.weight"] = b
            deltas[path] = scaling * b @ a
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return deltas


def _hf_reference(base: Path, peft_dir: str | None, deltas: dict[str, torch.Tensor], prompts):
    """HF greedy tokens and logprobs per prompt, with `deltas` merged into the weights and the
    PEFT adapter at `peft_dir` (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for path, delta in deltas.items():
            model.get_submodule(path).weight += delta
    if peft_dir is not None:
        model = PeftModel.from_pretrained(model, peft_dir)
    return hf_greedy_with_logprobs(model, prompts)


@pytest.fixture(scope="module", params=["qwen2_moe", "v3", pytest.param("qwen3_moe", marks=SLOW),
                                        pytest.param("glm4_moe", marks=SLOW),
                                        pytest.param("v2_lite", marks=SLOW)])
def setup(request, tmp_path_factory, byte_level_tokenizer_dir):
    root = tmp_path_factory.mktemp(f"lora_moe_shared_{request.param}")
    build, targets_a, targets_b = VARIANTS[request.param]
    base = build(request.param, root / "base", byte_level_tokenizer_dir)
    shapes = LoRAModelShapes.from_hf_config(json.loads((base / "config.json").read_text()))
    peft_dirs = {"a": make_peft_adapter(base, root / "peft_a", 8, targets_a, 16, False, seed=0,
                                        parameters=EXPERTS),
                 "b": make_peft_adapter(base, root / "peft_b", 4, targets_b, 8, True, seed=1,
                                        parameters=EXPERTS[:1])}
    # name -> (the engine's request, PEFT's folder, deltas merged into HF's weights)
    loras = {}
    for i, (name, peft_dir) in enumerate(peft_dirs.items()):
        deltas = _add_mlp_tensors(peft_dir, root / name, shapes, seed=10 + i) \
            if request.param in PEFT_CONVERTED and name == "a" else {}
        path = root / name if deltas else peft_dir
        loras[name] = (LoRARequest(name, i + 1, str(path)), str(peft_dir), deltas)
    # max_lora_rank 16: PEFT's conversion doubles the fused gate_up's rank (rank_pattern).
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True,
              max_loras=2, max_lora_rank=16, max_cpu_loras=3, max_num_batched_tokens=32,
              max_num_seqs=6)
    return request.param, base, loras, llm


def test_adapters_reach_every_kind_of_layer(setup):
    """The adapters hold tensors for the dense layers, the shared experts and the routed
    experts (else the oracle test below would not exercise them)."""
    variant, base, loras, llm = setup
    shapes = LoRAModelShapes.from_hf_config(json.loads((base / "config.json").read_text()))
    weights = load_peft_adapter(loras["a"][0], shapes, 16).weights
    dense = [i for i in range(shapes.num_layers) if not shapes.is_sparse(i)]
    sparse = [i for i in range(shapes.num_layers) if shapes.is_sparse(i)]
    assert sparse and (dense or variant == "qwen3_moe")   # (the tiny Qwen3-MoE: all sparse)
    assert all((i, "gate_proj") in weights for i in dense)
    assert all((i, "experts.gate_up") in weights and (i, "experts.down") in weights
               for i in sparse)
    if variant != "qwen3_moe":
        shared = "shared_expert" if variant == "qwen2_moe" else "shared_experts"
        assert all((i, f"{shared}.{m}") in weights for i in sparse for m in MLP)
    if variant == "qwen2_moe":
        assert all((i, "shared_expert_gate") in weights for i in sparse)
    if variant == "v3":
        assert all((i, m) in weights for i in range(shapes.num_layers)
                   for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"))


def test_mixed_batch_matches_hf_peft(setup):
    variant, base, loras, llm = setup
    prompts = _prompts()
    cycle = [None, loras["a"][0], loras["b"][0]]
    per_prompt = [cycle[i % 3] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                        lora_request=per_prompt)
    references = {None: _hf_reference(base, None, {}, prompts)}
    for name, (_, peft_dir, deltas) in loras.items():
        references[name] = _hf_reference(base, peft_dir, deltas, prompts)
    for i, (lora, out) in enumerate(zip(per_prompt, outs)):
        got_tokens, got_logprobs = _tokens_and_logprobs(out)
        want_tokens, want_logprobs = references[None if lora is None else lora.lora_name][i]
        assert got_tokens == want_tokens, f"{variant}: prompt {i} under {lora}"
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)
    base_tokens = [r[0] for r in references[None]]
    for name in ("a", "b"):
        assert [r[0] for r in references[name]] != base_tokens, name


def test_refusals_name_the_reason(setup, tmp_path):
    variant, base, loras, llm = setup
    if variant not in ("v3", "qwen2_moe"):
        pytest.skip("the refusals are the same for every family")
    hf = json.loads((base / "config.json").read_text())
    shapes = LoRAModelShapes.from_hf_config(hf)
    bad = tmp_path / "bad"
    bad.mkdir()
    dense_layer = next(i for i in range(shapes.num_layers) if not shapes.is_sparse(i))
    hidden, inter = hf["hidden_size"], hf["moe_intermediate_size"]
    experts = shapes.experts[0]
    # Routed-expert tensors on a dense layer.
    prefix = f"base_model.model.model.layers.{dense_layer}.mlp.experts"
    save_file({f"{prefix}.lora_A.weight": torch.ones(2 * experts, hidden),
               f"{prefix}.lora_B.weight": torch.ones(2 * inter, 2 * experts)},
              str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text(json.dumps({"r": 2}))
    with pytest.raises(ValueError, match=f"layer {dense_layer} lacks \\(a dense layer\\)"):
        load_peft_adapter(LoRARequest("bad", 9, str(bad)), shapes, 16)
    # PEFT's conversion gives the experts' gate_up rank 2r (rank_pattern): slots of r refuse it.
    if variant == "v3":
        with pytest.raises(ValueError, match="experts.gate_up has rank 16 \\(rank_pattern\\), "
                                             "which exceeds max_lora_rank \\(8\\)"):
            load_peft_adapter(loras["a"][0], shapes, 8)
        # MLA's kv_b_proj: refused by target_modules and by tensor name, naming the reason.
        kv_b = make_peft_adapter(base, tmp_path / "kv_b", 4, ["kv_b_proj"], 8, False, seed=2)
        with pytest.raises(ValueError, match="'kv_b_proj' is not supported: MLA never runs "
                                             "kv_b_proj as a linear layer"):
            llm.generate("hi", PARAMS, use_tqdm=False,
                         lora_request=LoRARequest("kv_b", 9, str(kv_b)))
        config = json.loads((kv_b / "adapter_config.json").read_text())
        config["target_modules"] = ["q_a_proj"]
        (kv_b / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="targets kv_b_proj, which is not supported"):
            load_peft_adapter(LoRARequest("kv_b", 9, str(kv_b)), shapes, 16)
    # The engine goes on.
    assert llm.generate("hi", PARAMS, use_tqdm=False, lora_request=loras["b"][0])


@pytest.mark.slow
def test_tensor_parallel_matches_one_process(setup):
    """tp=2 on worker processes: the shared experts' and dense MLPs' adapters sharded like
    their layers, MLA's q_b_proj by heads (q_a / kv_a replicated), o_proj's partial sums
    reduced with the base layer's; tokens and logprobs equal the single-process engine's."""
    variant, base, loras, llm = setup
    assert_tp2_equals_one_process(base, llm, [None, loras["a"][0], loras["b"][0], loras["a"][0]],
                                  max_lora_rank=16)
