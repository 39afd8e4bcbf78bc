"""LoRA on the token embedding and the LM head (PEFT's `embed_tokens` / `lm_head` targets)
against `transformers` + `peft` (fp32, greedy) on tiny random Llama checkpoints: one mixed
batch (base rows and three adapters: embedding + q/v, LM head + q/v with rsLoRA, both; with
chunked prefill) gives every request its adapter's tokens, generated and prompt logprobs within
1e-4; multi-step rounds (where the native decode loop would skip these adapters) and n-gram
speculative decoding keep the tokens; a tied embedding / LM head takes peft's separate
adapters on each; tensor parallelism (adapters whole on every rank) and pipeline parallelism
(slow run) give the tokens of HF + peft."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.peft import LoRAModelShapes, load_peft_adapter

MAX_TOKENS = 6
LOGPROB_TOL = 1e-4
PROMPT_LENGTHS = (5, 37, 12, 29, 21, 3, 44, 17)
# name -> (rank, target modules, lora_alpha, use_rslora)
VOCAB_ADAPTERS = {
    "emb": (4, ["embed_tokens", "q_proj", "v_proj"], 8, False),
    "head": (8, ["lm_head", "q_proj", "v_proj"], 16, True),
    "both": (4, ["embed_tokens", "lm_head"], 4, False),
}


def _make_adapter(base, out, rank, targets, alpha, rslora, seed):
    """A PEFT adapter with every LoRA matrix random (PEFT zeroes lora_B and, for an
    embedding, lora_embedding_A, which would make the adapter change nothing)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                  target_modules=targets, use_rslora=rslora))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    base = tiny_checkpoints["llama"]
    folder = tmp_path_factory.mktemp("lora_vocab")
    loras = {name: LoRARequest(name, i + 1, str(_make_adapter(base, folder / name, *spec, i)))
             for i, (name, spec) in enumerate(VOCAB_ADAPTERS.items())}
    return base, loras


def _prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _hf_reference(base, lora: LoRARequest | None, prompts):
    """Per prompt: (greedy tokens, their logprobs, the prompt tokens' logprobs) of HF + peft."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            tokens = gen.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                        for s, t in zip(gen.logits, tokens)]
            prompt_lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            out.append((tokens, logprobs,
                        prompt_lp.gather(1, ids[0, 1:, None])[:, 0].tolist()))
    return out


def _engine(base, **kwargs) -> LLM:
    args = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True,
                max_loras=3, max_lora_rank=8)
    args.update(kwargs)
    return LLM(str(base), **args)


def _results(out):
    completion = out.outputs[0]
    return (list(completion.token_ids),
            [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)],
            [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0,
                        prompt_logprobs=0)


def test_mixed_batch_matches_hf_peft(setup):
    base, loras = setup
    prompts = _prompts()
    cycle = [None, *loras.values()]
    per_prompt = [cycle[i % len(cycle)] for i in range(len(prompts))]
    outs = _engine(base, max_num_batched_tokens=32, max_num_seqs=8).generate(
        [{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
        lora_request=per_prompt)
    references = {None if lora is None else lora.lora_name: _hf_reference(base, lora, prompts)
                  for lora in cycle}
    for i, (lora, out) in enumerate(zip(per_prompt, outs)):
        tokens, logprobs, prompt_lp = _results(out)
        want_tokens, want_logprobs, want_prompt = references[
            None if lora is None else lora.lora_name][i]
        assert tokens == want_tokens, f"prompt {i} under {lora}"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(prompt_lp), torch.tensor(want_prompt),
                                   atol=LOGPROB_TOL, rtol=0)
    base_tokens = [r[0] for r in references[None]]
    for name in VOCAB_ADAPTERS:   # every adapter changes some tokens (else this proves nothing)
        assert [r[0] for r in references[name]] != base_tokens, name


@pytest.mark.parametrize("engine_args", [
    {"num_scheduler_steps": 4},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
], ids=["multi_step", "ngram"])
def test_other_engine_modes_keep_tokens(setup, engine_args):
    """Multi-step rounds (the native decode loop does not apply embedding / LM head adapters,
    so rounds with them run in Python) and n-gram drafts (verified on logits rows with the LM
    head adapter) give the plain engine's tokens."""
    base, loras = setup
    prompts = [{"prompt_token_ids": p} for p in _prompts(1)[:4]]
    per_prompt = [None, loras["emb"], loras["head"], loras["both"]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in _engine(base).generate(
        prompts, params, use_tqdm=False, lora_request=per_prompt)]
    got = _engine(base, **engine_args).generate(prompts, params, use_tqdm=False,
                                                lora_request=per_prompt)
    assert [list(o.outputs[0].token_ids) for o in got] == want


def test_tied_embedding_takes_peft_adapters(tiny_checkpoints, tmp_path):
    """With tie_word_embeddings, peft puts a separate adapter on the embedding and on the
    LM head (sharing only their base weight); the engine applies each where peft does."""
    base = tiny_checkpoints["llama_mqa_tied_llama3"]
    lora = LoRARequest("both", 1, str(_make_adapter(
        base, tmp_path / "both", 4, ["embed_tokens", "lm_head", "q_proj"], 8, False, 7)))
    prompts = _prompts(2, (9, 23))
    outs = _engine(base, max_loras=1).generate(
        [{"prompt_token_ids": p} for p in prompts] * 2, PARAMS, use_tqdm=False,
        lora_request=[lora, lora, None, None])
    want = _hf_reference(base, lora, prompts)
    for out, (want_tokens, want_logprobs, want_prompt) in zip(outs, want):
        tokens, logprobs, prompt_lp = _results(out)
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(prompt_lp), torch.tensor(want_prompt),
                                   atol=LOGPROB_TOL, rtol=0)
    assert [list(o.outputs[0].token_ids) for o in outs[2:]] != [w[0] for w in want]


@pytest.mark.parametrize("layout", [
    # (worker processes: 9-12 s each here)
    pytest.param(dict(tensor_parallel_size=2), marks=pytest.mark.slow),
    pytest.param(dict(pipeline_parallel_size=2), marks=pytest.mark.slow),
], ids=["tp2", "pp2"])
def test_parallel_matches_hf_peft(setup, layout):
    """Under tensor parallelism every rank holds the embedding and LM head adapters whole and
    adds them to the whole rows (after the embedding's all-reduce, the logits' all-gather);
    under pipeline parallelism the first stage applies the embedding's, the last the head's."""
    base, loras = setup
    prompts = _prompts(3, (7, 19, 30, 11))
    per_prompt = [None, loras["emb"], loras["head"], loras["both"]]
    llm = _engine(base, max_num_batched_tokens=32, distributed_executor_backend="mp", **layout)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                            use_tqdm=False, lora_request=per_prompt)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for i, (lora, out) in enumerate(zip(per_prompt, outs)):
        tokens, logprobs, prompt_lp = _results(out)
        want_tokens, want_logprobs, want_prompt = _hf_reference(base, lora, [prompts[i]])[0]
        assert tokens == want_tokens, f"prompt {i} under {lora}"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(prompt_lp), torch.tensor(want_prompt),
                                   atol=LOGPROB_TOL, rtol=0)


def test_resized_vocabulary_refused(setup, tmp_path):
    """PEFT's saved copy of the embedding base weight is accepted at the model's shape and
    refused at another (a resized vocabulary), naming the tensor."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    base, loras = setup
    shapes = LoRAModelShapes.from_hf_config(AutoConfig.from_pretrained(base).to_dict())
    adapter = load_peft_adapter(loras["both"], shapes, 8)
    assert {(-1, "embed_tokens"), (-1, "lm_head")} <= adapter.weights.keys()
    folder = tmp_path / "resized"
    shutil.copytree(loras["both"].lora_path, folder)
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = "base_model.model.model.embed_tokens.base_layer.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:2]])
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"{name} has shape .*resized vocabulary"):
        load_peft_adapter(LoRARequest("resized", 9, str(folder)), shapes, 8)
