"""Multi-LoRA under tensor and pipeline parallelism (worker processes, gloo on CPU): A and B are
sharded like their base layer (lora/layers.py), and one mixed batch (base rows and three random
adapters of ranks 4, 8 and 16 interleaved, chunked prefill) gives every request the greedy fp32
tokens of `transformers` + `peft` and of the single-process engine, logprobs within 1e-4.
Adapters loaded and unloaded while the engine serves reach every rank."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.serving_lora import LoRAModules
from pagedllm.lora.request import LoRARequest
from tests.lora.adapters import make_adapters
from tests.lora.test_lora_e2e import (LOGPROB_TOL, PARAMS, _hf_reference, _prompts,
                                      _tokens_and_logprobs)

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True,
                   max_loras=3, max_lora_rank=16, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def references(tiny_checkpoints, tmp_path_factory):
    """Per variant (built on first use): its base, adapters, prompts, each prompt's adapter
    (base and the three interleaved) and the HF + peft tokens and logprobs of each prompt."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            base = tiny_checkpoints[variant]
            folders = make_adapters(base, tmp_path_factory.mktemp(f"lora_par_{variant}"))
            loras = [None] + [LoRARequest(name, i + 1, str(path))
                              for i, (name, path) in enumerate(folders.items())]
            prompts = _prompts(5)[:6]
            per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
            rows = {lora: [i for i, other in enumerate(per_prompt) if other == lora]
                    for lora in loras}
            want = [None] * len(prompts)
            for lora, indices in rows.items():    # one HF + peft model per adapter
                refs = _hf_reference(base, lora, [prompts[i] for i in indices])
                for i, ref in zip(indices, refs):
                    want[i] = ref
            cache[variant] = base, prompts, per_prompt, want
        return cache[variant]

    return get


def _generate(base, prompts, per_prompt, **parallel):
    llm = LLM(str(base), **ENGINE_ARGS, **parallel)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                            lora_request=per_prompt)
        return [_tokens_and_logprobs(o) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def _assert_same(got, want, per_prompt):
    for i, ((tokens, logprobs), (want_tokens, want_logprobs), lora) in enumerate(
            zip(got, want, per_prompt)):
        assert tokens == want_tokens, f"prompt {i} under {lora}"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)


# "llama": 2 KV heads, one per rank; "llama_mqa_tied_llama3": its one KV head (and so the k/v
# rows of B) on both ranks. Only tp2 is in the default run.
@pytest.mark.parametrize("variant, layout", [
    ("llama", dict(tensor_parallel_size=2)),
    pytest.param("llama_mqa_tied_llama3", dict(tensor_parallel_size=2), marks=pytest.mark.slow),
    pytest.param("llama", dict(pipeline_parallel_size=2), marks=pytest.mark.slow),
    pytest.param("llama_mqa_tied_llama3", dict(tensor_parallel_size=2, pipeline_parallel_size=2),
                 marks=pytest.mark.slow),
], ids=["tp2", "tp2_replicated_kv", "pp2", "tp2_pp2"])
def test_parallel_mixed_batch_matches_hf_peft_and_one_process(references, variant, layout):
    base, prompts, per_prompt, want = references(variant)
    got = _generate(base, prompts, per_prompt, distributed_executor_backend="mp", **layout)
    _assert_same(got, want, per_prompt)
    _assert_same(got, _generate(base, prompts, per_prompt), per_prompt)
    base_tokens = [t for (t, _), lora in zip(want, per_prompt) if lora is None]
    assert any(t not in base_tokens for (t, _), lora in zip(want, per_prompt) if lora), \
        "the adapters must change the tokens"


async def _complete(engine: AsyncLLM, prompt: list[int], lora: LoRARequest, request_id: str):
    stream = await engine.add_request(request_id, {"prompt_token_ids": prompt}, PARAMS,
                                      lora_request=lora)
    last = None
    async for out in stream:
        last = out
    return _tokens_and_logprobs(last)


def test_runtime_load_and_unload_reach_every_rank(references):
    """The server's adapter table over a tp=2 engine: an adapter loaded while serving, unloaded,
    and its name loaded again from another adapter's folder (a new id) gives, on both ranks'
    shards, that folder's tokens."""
    base, prompts, per_prompt, want = references("llama")
    first, second = per_prompt[1], per_prompt[3]     # ranks 4 and 16, all linear layers
    engine = AsyncLLM.from_engine_args(str(base), **ENGINE_ARGS, tensor_parallel_size=2,
                                       distributed_executor_backend="mp")

    async def scenario():    # one event loop: the engine binds to the first one it serves
        modules = LoRAModules(engine, ["base"])
        lora = modules.load("custom", first.lora_path)
        _assert_same([await _complete(engine, prompts[1], lora, "a")], [want[1]], [lora])
        modules.unload("custom")
        lora = modules.load("custom", second.lora_path)
        _assert_same([await _complete(engine, prompts[3], lora, "b")], [want[3]], [lora])

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_tp2_through_ray_actors_matches_one_process_and_hf_peft(references):
    """The same mixed batch (base rows and three adapters) with tp=2 on Ray actors
    (`distributed_executor_backend="ray"`): every adapter reaches both actors' shards, tokens
    and logprobs equal the single-process (uni) engine's and HF + peft's. Slow: Ray starts."""
    pytest.importorskip("ray")
    base, prompts, per_prompt, want = references("llama")
    got = _generate(base, prompts, per_prompt, distributed_executor_backend="ray",
                    tensor_parallel_size=2)
    _assert_same(got, _generate(base, prompts, per_prompt), per_prompt)
    _assert_same(got, want, per_prompt)
    base_tokens = [t for (t, _), lora in zip(want, per_prompt) if lora is None]
    assert any(t not in base_tokens for (t, _), lora in zip(want, per_prompt) if lora), \
        "the adapters must change the tokens"
