"""Multi-LoRA end to end against `transformers` + `peft` (fp32, greedy) on tiny random Llama and
Qwen3 checkpoints with three random adapters (ranks 4, 8 and 16; the rank-8 one on attention
only, with rsLoRA scaling): one mixed batch (base rows and all three adapters interleaved,
chunked prefill through a small token budget) gives each request the tokens and logprobs of
its adapter under HF + PEFT and of itself run alone; the prefix cache never shares a block
between adapters and does within one; preemption changes nothing."""

from __future__ import annotations

import random

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import ADAPTERS, make_adapters

MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
PROMPT_LENGTHS = (5, 37, 12, 50, 21, 3, 44, 17)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tiny_checkpoints, tmp_path_factory):
    base = tiny_checkpoints[request.param]
    adapters = make_adapters(base, tmp_path_factory.mktemp(f"lora_{request.param}"))
    loras = {name: LoRARequest(name, i + 1, str(path))
             for i, (name, path) in enumerate(adapters.items())}
    return base, loras


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in PROMPT_LENGTHS]


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def _hf_reference(base, lora: LoRARequest | None, prompts):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path)
    model.eval()
    with torch.no_grad():
        return [_hf_greedy(model, p) for p in prompts]


def _engine(base, **kwargs) -> LLM:
    args = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True,
                max_loras=3, max_lora_rank=16)
    args.update(kwargs)
    return LLM(str(base), **args)


def _tokens_and_logprobs(out):
    completion = out.outputs[0]
    return (list(completion.token_ids),
            [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)])


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def test_mixed_batch_matches_hf_peft_and_requests_alone(setup):
    base, loras = setup
    prompts = _prompts()
    # base, r4, r8_attn, r16, base, r4, ... interleaved
    cycle = [None, *loras.values()]
    per_prompt = [cycle[i % len(cycle)] for i in range(len(prompts))]
    llm = _engine(base, max_num_batched_tokens=32, max_num_seqs=8)
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
        alone = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False,
                             lora_request=lora)[0]
        assert _tokens_and_logprobs(alone)[0] == got_tokens
    # Every adapter changes the base model's tokens somewhere (else the test proves nothing).
    base_tokens = [r[0] for r in references[None]]
    for name in ADAPTERS:
        assert [r[0] for r in references[name]] != base_tokens, name


def test_prefix_cache_keyed_by_adapter(setup):
    base, loras = setup
    prompt = {"prompt_token_ids": _prompts(1)[3]}   # 50 tokens: 3 full blocks of 16
    llm = _engine(base, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def hits(lora) -> int:
        before = llm.get_stats().prefix_cache_stats.hits
        llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return llm.get_stats().prefix_cache_stats.hits - before

    assert hits(loras["r4"]) == 0
    assert hits(loras["r16"]) == 0, "a block of adapter r4 served adapter r16"
    assert hits(None) == 0, "a block of an adapter served the base model"
    assert hits(loras["r4"]) == 48
    assert hits(loras["r16"]) == 48
    assert hits(None) == 48


def test_preemption_and_lora_budget_keep_tokens(setup):
    """Few KV blocks force preemptions (recompute), and max_loras=1 makes the scheduler hold
    back requests of other adapters; every request still gets its own adapter's tokens."""
    base, loras = setup
    prompts = [{"prompt_token_ids": p} for p in _prompts(2)]
    per_prompt = [list(loras.values())[i % 3] if i % 4 else None for i in range(len(prompts))]
    want = [_tokens_and_logprobs(o)[0] for o in _engine(base).generate(
        prompts, PARAMS, use_tqdm=False, lora_request=per_prompt)]
    tight = _engine(base, num_gpu_blocks_override=10, max_num_batched_tokens=64)
    outs = tight.generate(prompts, PARAMS, use_tqdm=False, lora_request=per_prompt)
    assert tight.get_stats().num_preemptions > 0
    assert [_tokens_and_logprobs(o)[0] for o in outs] == want
    one_slot = _engine(base, max_loras=1)
    outs = one_slot.generate(prompts, PARAMS, use_tqdm=False, lora_request=per_prompt)
    assert [_tokens_and_logprobs(o)[0] for o in outs] == want


@pytest.mark.parametrize("engine_args", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    {"async_scheduling": True},
    {"num_scheduler_steps": 4},
], ids=["ngram", "async", "multi_step"])
def test_other_engine_modes_keep_adapter_tokens(setup, engine_args):
    """n-gram drafts (verified under the adapter), async scheduling and multi-step rounds (for
    base requests), and n > 1 give the tokens of the plain engine."""
    base, loras = setup
    prompts = [{"prompt_token_ids": p} for p in _prompts(3)[:4]]
    per_prompt = [None, loras["r4"], loras["r8_attn"], loras["r16"]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in _engine(base).generate(
        prompts, params, use_tqdm=False, lora_request=per_prompt)]
    llm = _engine(base, **engine_args)
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    two = llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True, n=2),
                       use_tqdm=False, lora_request=per_prompt[1])[0]
    assert [list(c.token_ids) for c in two.outputs] == [want[1], want[1]]


def test_multi_step_round_with_a_request_leaving_early(setup):
    """A multi-step round whose base request stops at a stop token mid-round: the adapter
    requests' later steps are gathered again (a new token-to-slot mapping) and keep their
    tokens."""
    base, loras = setup
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)[:4]]
    per_prompt = [None, loras["r4"], loras["r8_attn"], loras["r16"]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in _engine(base).generate(
        prompts, params, use_tqdm=False, lora_request=per_prompt)]
    stop = want[0][3]
    stopping = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              stop_token_ids=[stop])
    got = _engine(base, num_scheduler_steps=8).generate(
        prompts, [stopping, params, params, params], use_tqdm=False, lora_request=per_prompt)
    assert list(got[0].outputs[0].token_ids) == want[0][:want[0].index(stop) + 1]
    assert [list(o.outputs[0].token_ids) for o in got[1:]] == want[1:]
