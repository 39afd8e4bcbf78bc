"""LoRA on MoE experts against `transformers` + `peft` (fp32, greedy) on a tiny random Mixtral
(OLMoE in the slow run): adapters made by `peft` on transformers 5's 3-D expert parameters
(`target_parameters`), with attention targets beside them; one mixed batch (base rows and two
adapters interleaved, chunked prefill) gives each request the tokens and logprobs of its adapter
under HF + PEFT and of itself run alone. The per-expert layout (transformers 4's
`experts.{e}.w1/w2/w3` modules) of the same adapter gives the same tokens; the layer agrees
with a per-token loop; unsupported set-ups are refused naming the reason."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import create_engine_config
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE, select_experts
from pagedllm.lora.layers import LoRAStepState
from pagedllm.lora.moe import EXPERT_SLICES, LoRAFusedMoE
from pagedllm.lora.ops import LoRAMapping
from pagedllm.lora.peft import LoRAModelShapes, load_peft_adapter
from tests.lora.adapters import make_peft_adapter
from tests.models.test_moe import _build

MAX_TOKENS = 6
# The base MoE models' own tolerance against HF (tests/models/test_gemma.py: fp32
# reduction-order noise of the packed CPU GEMM, up to 2.1e-4 seen on Mixtral without adapters).
LOGPROB_TOL = 4e-4
PROMPT_LENGTHS = (5, 37, 12, 50, 21, 9)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# name -> (rank, target modules, lora_alpha, use_rslora, target parameters)
MOE_ADAPTERS = {
    "experts_r8": (8, ["q_proj", "v_proj"], 16, False, EXPERT_PARAMETERS),
    "experts_r4": (4, ["o_proj"], 8, True, ["mlp.experts.gate_up_proj"]),
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["mixtral", pytest.param("olmoe", marks=pytest.mark.slow)])
def setup(request, tmp_path_factory, byte_level_tokenizer_dir):
    root = tmp_path_factory.mktemp(f"lora_moe_{request.param}")
    base = _build(request.param, root / "base", byte_level_tokenizer_dir)
    loras = {}
    for i, (name, (rank, targets, alpha, rslora, parameters)) in enumerate(
            MOE_ADAPTERS.items()):
        path = make_peft_adapter(base, root / name, rank, targets, alpha, rslora, seed=i,
                                 parameters=parameters)
        loras[name] = LoRARequest(name, i + 1, str(path))
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True,
              max_loras=2, max_lora_rank=8, max_cpu_loras=3, max_num_batched_tokens=32,
              max_num_seqs=6)
    return base, loras, llm


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in PROMPT_LENGTHS]


def _hf_reference(base: Path, lora: LoRARequest | None, prompts):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path)
    return hf_greedy_with_logprobs(model, prompts)


def hf_greedy_with_logprobs(model, prompts) -> list[tuple[list[int], list[float]]]:
    """HF's greedy MAX_TOKENS tokens of each prompt and their logprobs."""
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            results.append((tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                                     for step, t in zip(out.logits, tokens)]))
    return results


def _tokens_and_logprobs(out):
    completion = out.outputs[0]
    return (list(completion.token_ids),
            [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)])


def test_mixed_batch_matches_hf_peft_and_requests_alone(setup):
    base, loras, llm = setup
    prompts = _prompts()
    cycle = [None, loras["experts_r8"], loras["experts_r4"]]
    per_prompt = [cycle[i % 3] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                        lora_request=per_prompt)
    references = {None if lora is None else lora.lora_name: _hf_reference(base, lora, prompts)
                  for lora in cycle}
    for i, (prompt, lora, out) in enumerate(zip(prompts, per_prompt, outs)):
        got_tokens, got_logprobs = _tokens_and_logprobs(out)
        want_tokens, want_logprobs = references[None if lora is None else lora.lora_name][i]
        assert got_tokens == want_tokens, f"prompt {i} under {lora}"
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)
    alone = llm.generate([{"prompt_token_ids": prompts[4]}], PARAMS, use_tqdm=False,
                         lora_request=per_prompt[4])[0]
    assert _tokens_and_logprobs(alone)[0] == _tokens_and_logprobs(outs[4])[0]
    # Each adapter changes the base model's tokens (else the test proves nothing).
    base_tokens = [r[0] for r in references[None]]
    for name in MOE_ADAPTERS:
        assert [r[0] for r in references[name]] != base_tokens, name


def _per_expert_copy(lora: LoRARequest, out: Path, hf: dict) -> LoRARequest:
    """The same adapter in transformers 4's layout: one module per expert (Mixtral's
    w1/w3/w2 or gate/up/down_proj), gate_up's A shared by its gate and up halves."""
    config = json.loads((Path(lora.lora_path) / "adapter_config.json").read_text())
    rank, mixtral = config["r"], "num_local_experts" in hf
    num_experts = hf.get("num_local_experts") or hf["num_experts"]
    tensors = {}
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for name, tensor in load_file(str(Path(lora.lora_path) / "adapter_model.safetensors")).items():
        if ".experts." not in name:
            tensors[name] = tensor
            continue
        if ".lora_B." in name:
            continue
        prefix = name.split(".experts")[0] + ".experts"
        wrapper = name[:-len(".lora_A.weight")]
        a = tensor.view(num_experts, rank, -1)
        b = load_file(str(Path(lora.lora_path) / "adapter_model.safetensors"))[
            f"{wrapper}.lora_B.weight"]
        b = b.view(b.shape[0], rank, num_experts).permute(2, 0, 1)
        gate_up = a.shape[2] == hf["hidden_size"] and b.shape[1] == 2 * hf["intermediate_size"]
        for e in range(num_experts):
            pieces = ([(names[0], b[e, :b.shape[1] // 2]), (names[1], b[e, b.shape[1] // 2:])]
                      if gate_up else [(names[2], b[e])])
            for module, b_e in pieces:
                tensors[f"{prefix}.{e}.{module}.lora_A.weight"] = a[e].clone()
                tensors[f"{prefix}.{e}.{module}.lora_B.weight"] = b_e.clone()
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config["target_modules"] = [*config["target_modules"], *names]
    config.pop("target_parameters", None)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return LoRARequest(f"{lora.lora_name}_per_expert", 10 + lora.lora_int_id, str(out))


def test_per_expert_layout_gives_the_same_tokens(setup, tmp_path):
    base, loras, llm = setup
    copy = _per_expert_copy(loras["experts_r8"], tmp_path / "per_expert",
                            json.loads((base / "config.json").read_text()))
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = llm.generate(prompts, params, use_tqdm=False, lora_request=loras["experts_r8"])
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=copy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    base_out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base_out] != [o.outputs[0].token_ids for o in want]


def test_layer_matches_a_per_token_loop():
    """Two slots (rank 3 fused gate_up + down; rank 2 per-expert gate and up) and base rows in
    one batch: the wrapper equals each token's own experts with its adapter's weights merged."""
    torch.manual_seed(0)
    experts, top_k, hidden, inter, rank = 4, 2, 8, 6, 3
    layer = FusedMoE(experts, top_k, hidden, inter, True)
    layer.w13_weight.data.normal_()
    layer.w2_weight.data.normal_()
    state = LoRAStepState()
    wrapper = LoRAFusedMoE(layer, 2, rank, state, torch.device("cpu"), torch.float32)
    gate_up = (torch.randn(experts, rank, hidden), torch.randn(experts, 2 * inter, rank))
    down = (torch.randn(experts, rank, inter), torch.randn(experts, hidden, rank))
    gate = (torch.randn(experts, 2, hidden), torch.randn(experts, inter, 2))
    up = (torch.randn(experts, 2, hidden), torch.randn(experts, inter, 2))
    wrapper.set_lora(0, EXPERT_SLICES.index("experts.gate_up"), *gate_up)
    wrapper.set_lora(0, EXPERT_SLICES.index("experts.down"), *down)
    wrapper.set_lora(1, EXPERT_SLICES.index("experts.gate"), *gate)
    wrapper.set_lora(1, EXPERT_SLICES.index("experts.up"), *up)
    merged = [(layer.w13_weight + torch.einsum("eor,eri->eoi", gate_up[1], gate_up[0]),
               layer.w2_weight + torch.einsum("eor,eri->eoi", down[1], down[0])),
              (layer.w13_weight + torch.cat([torch.einsum("eor,eri->eoi", gate[1], gate[0]),
                                             torch.einsum("eor,eri->eoi", up[1], up[0])], 1),
               layer.w2_weight)]
    slots = torch.tensor([1, -1, 0, 0, 1, -1, 0, 1, 1, -1])
    x, logits = torch.randn(len(slots), hidden), torch.randn(len(slots), experts)
    order = torch.argsort(slots, stable=True)[int((slots < 0).sum()):]
    segments = tuple((s, int((slots[order] < s).sum()), int((slots[order] <= s).sum()))
                     for s in (0, 1))
    state.mapping = LoRAMapping(order, segments, batch_slots=slots)
    got = wrapper(x, logits)
    weights, ids = select_experts(logits, top_k, True)
    act = SiluAndMul()
    for t in range(len(slots)):
        w13, w2 = ((layer.w13_weight, layer.w2_weight) if slots[t] < 0
                   else merged[int(slots[t])])
        want = sum(weights[t, j] * (act(x[t:t + 1] @ w13[e].t()) @ w2[e].t())
                   for j, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(got[t:t + 1], want, atol=1e-4, rtol=1e-4)
    state.mapping = None
    torch.testing.assert_close(wrapper(x, logits), layer(x, logits))


def test_refusals_name_the_reason(setup, tmp_path, tiny_checkpoints):
    base, loras, llm = setup
    with pytest.raises(ValueError, match="LoRA on MoE experts is not supported with "
                                         "enable_expert_parallel"):
        create_engine_config(str(base), enable_lora=True, enable_expert_parallel=True,
                             tensor_parallel_size=2)
    layer = FusedMoE(4, 2, 8, 6, True)
    layer.quant_method = object()
    with pytest.raises(ValueError, match="quantized experts"):
        LoRAFusedMoE(layer, 1, 4, LoRAStepState(), torch.device("cpu"), torch.float32)
    # An experts adapter on a dense model, and a dense MLP adapter on the MoE model.
    llama_shapes = LoRAModelShapes.from_hf_config(
        json.loads((tiny_checkpoints["llama"] / "config.json").read_text()))
    with pytest.raises(ValueError, match="MoE experts, which the model lacks"):
        load_peft_adapter(loras["experts_r8"], llama_shapes, 16)
    moe_shapes = LoRAModelShapes.from_hf_config(json.loads((base / "config.json").read_text()))
    dense = tmp_path / "dense"
    dense.mkdir()
    save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.ones(2, 64),
               "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.ones(64, 2)},
              str(dense / "adapter_model.safetensors"))
    (dense / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    with pytest.raises(ValueError, match="'gate_proj', which the model lacks"):
        load_peft_adapter(LoRARequest("dense", 9, str(dense)), moe_shapes, 16)
    # A router target, and expert tensors of the wrong shape.
    (dense / "adapter_config.json").write_text(json.dumps(
        {"r": 2, "target_parameters": ["mlp.gate.weight"]}))
    with pytest.raises(ValueError, match="target parameters"):
        load_peft_adapter(LoRARequest("dense", 9, str(dense)), moe_shapes, 16)
    (dense / "adapter_config.json").write_text(json.dumps({"r": 2}))
    save_file({"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.ones(3, 64),
               "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.ones(64, 3)},
              str(dense / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="fit neither experts.gate_up_proj"):
        load_peft_adapter(LoRARequest("dense", 9, str(dense)), moe_shapes, 16)
    # The engine refuses the bad adapter alone and goes on.
    with pytest.raises(ValueError, match="fit neither"):
        llm.generate("hi", PARAMS, use_tqdm=False,
                     lora_request=LoRARequest("bad", 9, str(dense)))
    assert llm.generate("hi", PARAMS, use_tqdm=False, lora_request=loras["experts_r4"])


@pytest.mark.slow
def test_tensor_parallel_expert_adapters_match_one_process(setup):
    """tp=2 on worker processes: each rank holds its shard of the experts' adapters (B13's rows
    of gate and up, A2's columns) and the tokens and logprobs equal the single-process
    engine's."""
    base, loras, llm = setup
    assert_tp2_equals_one_process(
        base, llm, [None, loras["experts_r8"], loras["experts_r4"], loras["experts_r8"]],
        max_lora_rank=8)


def assert_tp2_equals_one_process(base: Path, llm: LLM, per_prompt: list, max_lora_rank: int):
    """The first four prompts under `per_prompt`'s adapters give the same tokens and logprobs
    (within LOGPROB_TOL) on `llm` and on a tp=2 engine of `base` on worker processes."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
    want = [_tokens_and_logprobs(o) for o in llm.generate(
        prompts, PARAMS, use_tqdm=False, lora_request=per_prompt)]
    tp = LLM(str(base), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True,
             max_loras=2, max_lora_rank=max_lora_rank, max_num_batched_tokens=32,
             max_num_seqs=6, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        got = [_tokens_and_logprobs(o) for o in tp.generate(
            prompts, PARAMS, use_tqdm=False, lora_request=per_prompt)]
    finally:
        tp.llm_engine.engine_core.shutdown()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)
