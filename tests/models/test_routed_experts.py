"""Routed-experts capture (`enable_return_routed_experts`, RL routing replay).

Oracle: HF transformers in fp32 with `output_router_logits=True` on the same tiny random
checkpoint: for prompt + output but the last token, each MoE layer's top-k of the router's
softmax must be the experts the engine returns. Under chunked prefill, batching, prefix caching
(cached prompt tokens carry the routing recorded when their blocks were computed), preemption
(recomputed positions are overwritten, not duplicated), tensor and expert parallelism (slow).
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.config import create_engine_config
from pagedllm.core.routed_experts import RoutedExperts, RoutedExpertsRecord
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.core_serial import make_encoder
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import RequestOutputKind
from tests.models.test_deepseek import VARIANTS as DEEPSEEK_VARIANTS
from tests.models.test_deepseek import build_checkpoint as build_deepseek
from tests.models.test_gemma import VOCAB_HIGH, VOCAB_LOW
from tests.models.test_moe import MOE_VARIANTS, _build

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, byte_level_tokenizer_dir):
    root = tmp_path_factory.mktemp("routed_experts")
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            build = build_deepseek if name in DEEPSEEK_VARIANTS else _build
            paths[name] = build(name, root / name, byte_level_tokenizer_dir)
        return paths[name]

    return get


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    models: dict[str, torch.nn.Module] = {}

    def get(name: str):
        if name not in models:
            models[name] = AutoModelForCausalLM.from_pretrained(checkpoints(name),
                                                                dtype=torch.float32).eval()
        return models[name]

    return get


@pytest.fixture(scope="module")
def chunked_llm(checkpoints):
    """An engine per variant with chunks of 7 tokens shared by up to 3 requests and blocks of
    8 tokens (prompts of its tests do not share prefixes across tests)."""
    engines: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in engines:
            engines[name] = LLM(str(checkpoints(name)), dtype="float32",
                                kv_cache_memory_bytes=8 << 20, block_size=8,
                                max_num_batched_tokens=7, max_num_seqs=3,
                                enable_return_routed_experts=True)
        return engines[name]

    return get


def hf_routed_experts(hf, token_ids: list[int], top_k: int) -> np.ndarray:
    """[len(token_ids), num_moe_layers, top_k]: HF's router top-k (by softmax probability) of
    every MoE layer for each token, sorted per row."""
    with torch.no_grad():
        out = hf(torch.tensor([token_ids]), output_router_logits=True)
    layers = [logits.reshape(len(token_ids), -1) for logits in out.router_logits]
    ids = [torch.topk(torch.softmax(lg.float(), -1), top_k, dim=-1).indices for lg in layers]
    return np.sort(torch.stack(ids, dim=1).numpy(), axis=-1)


def hf_router_topk(hf, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), num_moe_layers, top_k]: the ids HF's DeepSeek / GLM-4 routers
    (`*TopkRouter`, which return (logits, weights, ids)) chose, sorted per row."""
    ids = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: ids.append(out[2]))
             for m in hf.modules() if type(m).__name__.endswith("TopkRouter")]
    try:
        with torch.no_grad():
            hf(torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return np.sort(torch.stack(ids, dim=1).numpy(), axis=-1)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(21)]
    alone = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in (5, 17, 30)]
    shared = [prefix + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in (3, 9)]
    return alone + shared


def assert_matches_hf(outputs, hf, top_k: int, num_moe_layers: int,
                      reference=None) -> None:
    reference = reference or (lambda tokens: hf_routed_experts(hf, tokens, top_k))
    for out in outputs:
        completion = out.outputs[0]
        tokens = list(out.prompt_token_ids) + list(completion.token_ids)
        got = completion.routed_experts
        assert got is not None and got.dtype == np.int32
        assert got.shape == (len(tokens) - 1, num_moe_layers, top_k)
        np.testing.assert_array_equal(np.sort(got, axis=-1), reference(tokens[:-1]))


@pytest.mark.parametrize("variant, num_moe_layers",
                         [("mixtral", 4), pytest.param("qwen2_moe", 3, marks=pytest.mark.slow)])
def test_routed_experts_match_hf_router(chunked_llm, hf_models, variant, num_moe_layers):
    """Chunks of 7 tokens shared by up to 3 requests, then two requests whose 16-token prefix
    comes from the prefix cache; Qwen2-MoE's layer 2 is dense (3 MoE layers)."""
    top_k = MOE_VARIANTS[variant][2]["num_experts_per_tok"]
    llm = chunked_llm(variant)
    prompts = _prompts(0)
    outputs = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    outputs += llm.generate(prompts[4:], GREEDY, use_tqdm=False)
    assert outputs[-1].num_cached_tokens == 16
    assert_matches_hf(outputs, hf_models(variant), top_k, num_moe_layers)


@pytest.mark.parametrize("variant", [pytest.param("v3", marks=pytest.mark.slow),
                                     pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_deepseek_style_routers_match_hf(checkpoints, hf_models, variant):
    """Sigmoid scores with a correction bias, group-limited (FusedMoE.forward_routed); the
    first layer is dense (2 MoE layers)."""
    top_k = DEEPSEEK_VARIANTS[variant][2]["num_experts_per_tok"]
    llm = LLM(str(checkpoints(variant)), dtype="float32", kv_cache_memory_bytes=8 << 20,
              block_size=8, max_num_batched_tokens=7, max_num_seqs=3,
              enable_return_routed_experts=True)
    hf = hf_models(variant)
    outputs = llm.generate(_prompts(4)[1:], GREEDY, use_tqdm=False)
    assert outputs[-1].num_cached_tokens == 16
    assert_matches_hf(outputs, hf, top_k, 2, lambda tokens: hf_router_topk(hf, tokens))


def test_preemption_recomputes_without_duplicates(checkpoints, hf_models):
    """A KV cache so small that requests are preempted and recomputed: every position's routing
    appears once, equal to HF's."""
    llm = LLM(str(checkpoints("mixtral")), dtype="float32", num_gpu_blocks_override=12,
              block_size=8, max_model_len=64, enable_return_routed_experts=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(_prompts(1)[1:], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert_matches_hf(outputs, hf_models("mixtral"), 2, 4)


@pytest.mark.slow   # two more engines
def test_disabled_engine_and_opted_out_request_return_none(checkpoints):
    path = str(checkpoints("mixtral"))
    prompt = _prompts(2)[0]
    plain = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].routed_experts is None
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20,
              enable_return_routed_experts=True)
    opted_out = SamplingParams(temperature=0.0, max_tokens=4, return_routed_experts=False)
    out = llm.generate([prompt, prompt], [opted_out, GREEDY], use_tqdm=False)
    assert out[0].outputs[0].routed_experts is None
    assert out[1].outputs[0].routed_experts.shape == (len(prompt) + 11, 4, 2)


def test_record_overwrites_by_position_and_rows_cross_the_engine_core_wire():
    rows = np.arange(24, dtype=np.int16).reshape(4, 3, 2)
    out = EngineCoreOutput("r", [], new_routed_experts=(2, RoutedExperts.from_numpy(rows[2:])))
    back = msgspec.msgpack.decode(make_encoder().encode(out), type=EngineCoreOutput)
    start, wire_rows = back.new_routed_experts
    record = RoutedExpertsRecord()
    record.write(0, rows[:3] + 100)
    record.write(start, wire_rows.to_numpy())   # position 2 recomputed (preemption)
    record.write(0, rows[:2])
    want = np.concatenate([rows, np.full((1, 3, 2), -1, dtype=np.int16)]).astype(np.int32)
    got = record.result(5)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(record.result(2), want[:2])
    assert RoutedExpertsRecord().result(3) is None


def _stop_string_of(text: str, min_start: int) -> str:
    """A 2-character piece of `text` first found at or after `min_start`, ending before the
    text does (so a run stopped by it returns a strict prefix of the tokens)."""
    for i in range(min_start, len(text) - 3):
        piece = text[i:i + 2]
        if text.find(piece) == i and piece.isprintable() and "\ufffd" not in piece:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def assert_stop_string_keeps_prefix_routing(llm, prompts) -> None:
    """#44: a request that a stop string ends (the front end aborts it in the core) returns
    the routing of its returned tokens: the no-stop run's rows, cut to those tokens."""
    full = llm.generate(prompts, GREEDY, use_tqdm=False)
    stops = [_stop_string_of(out.outputs[0].text, 2) for out in full]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
              for stop in stops]
    stopped = llm.generate(prompts, params, use_tqdm=False)
    for prompt, ref, out, stop in zip(prompts, full, stopped, stops):
        ref_c, c = ref.outputs[0], out.outputs[0]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        num = len(c.token_ids)
        assert 0 < num < len(ref_c.token_ids)
        assert list(c.token_ids) == list(ref_c.token_ids)[:num]
        assert c.routed_experts is not None
        assert c.routed_experts.shape == (len(prompt) + num - 1,) + ref_c.routed_experts.shape[1:]
        np.testing.assert_array_equal(c.routed_experts,
                                      ref_c.routed_experts[:len(prompt) + num - 1])


def test_stop_string_returns_routing_of_returned_tokens(chunked_llm):
    assert_stop_string_keeps_prefix_routing(chunked_llm("mixtral"), _prompts(5)[:3])


def test_stop_string_within_a_delta_cuts_routing_to_kept_tokens(byte_level_tokenizer_dir):
    """Several tokens in one delta (accepted drafts): a stop string completed by the second
    drops the third token and its routing; a prefill chunk's routing-only delta emits no
    output."""
    tokenizer = load_tokenizer(str(byte_level_tokenizer_dir), False, None)
    a, b, c = (tokenizer.encode(t, add_special_tokens=False) for t in "xyz")
    assert len(a) == len(b) == len(c) == 1
    prompt = [VOCAB_LOW + i for i in range(5)]
    rows = np.arange(8 * 2 * 2, dtype=np.int16).reshape(8, 2, 2)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, prompt,
                          SamplingParams(max_tokens=10, stop=["xy"],
                                         output_kind=RequestOutputKind.DELTA))
    wire = lambda start, end: (start, RoutedExperts.from_numpy(rows[start:end]))  # noqa: E731
    outs, to_abort = processor.process_outputs(
        [EngineCoreOutput("r", [], new_routed_experts=wire(0, 3))])   # a prefill chunk
    assert outs == [] and to_abort == []
    outs, to_abort = processor.process_outputs(
        [EngineCoreOutput("r", a + b + c, new_routed_experts=wire(3, 8))])
    assert to_abort == ["r"]
    completion = outs[0].outputs[0]
    assert completion.token_ids == a + b and completion.stop_reason == "xy"
    # prompt (5) + kept outputs (2) - 1 rows: the third token's input row is dropped.
    np.testing.assert_array_equal(completion.routed_experts, rows[:6].astype(np.int32))


@pytest.mark.slow
def test_engine_core_process_returns_them(checkpoints, hf_models):
    """multiprocess_mode: the rows cross the msgpack wire from the engine-core process, also
    for requests that a stop string ends (aborted in the core's process)."""
    llm = LLM(str(checkpoints("mixtral")), dtype="float32", kv_cache_memory_bytes=8 << 20,
              multiprocess_mode=True, enable_return_routed_experts=True)
    try:
        out = llm.generate(_prompts(2)[:2], GREEDY, use_tqdm=False)
        assert_stop_string_keeps_prefix_routing(llm, _prompts(5)[:3])
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert_matches_hf(out, hf_models("mixtral"), 2, 4)


def test_dense_model_and_unsupported_combinations_are_refused(checkpoints, tiny_llama):
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20,
            enable_return_routed_experts=True)
    path = str(checkpoints("mixtral"))
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        create_engine_config(path, pipeline_parallel_size=2, enable_return_routed_experts=True)
    with pytest.raises(ValueError, match="KV connector"):
        create_engine_config(path, kv_offloading_size=1, enable_return_routed_experts=True)
    for bad in (dict(async_scheduling=True), dict(num_scheduler_steps=4)):
        with pytest.raises(ValueError, match="enable_return_routed_experts"):
            LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20,
                enable_return_routed_experts=True, **bad)
    with pytest.raises(ValueError, match="return_routed_experts must be a boolean"):
        SamplingParams(return_routed_experts="yes")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)])
def test_tensor_and_expert_parallel_match_hf(checkpoints, hf_models, parallel):
    llm = LLM(str(checkpoints("mixtral")), dtype="float32", kv_cache_memory_bytes=8 << 20,
              max_num_batched_tokens=16, distributed_executor_backend="mp",
              enable_return_routed_experts=True, **parallel)
    try:
        outputs = llm.generate(_prompts(3)[:3], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert_matches_hf(outputs, hf_models("mixtral"), 2, 4)
