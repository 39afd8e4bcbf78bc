"""Structured output (issue #9): the constraint, not the model, guarantees valid outputs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, GenerateError, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        # NOTE(tests): length-bounded strings (xgrammar 0.2.9 lets control characters in; the
        # engine corrects it) are covered by test_json_schema_fix.py / _property.py.
        "name": {"type": "string", "pattern": "^[a-z ]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=16 << 20)


def _sampled(spec, n=6, max_tokens=80):
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                           structured_outputs=spec) for i in range(n)]


def test_json_schema_regex_choice_grammar(llm):
    outs = llm.generate(["Once upon a time"] * 6, _sampled({"json": SCHEMA}), use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    outs = llm.generate(["x"] * 6, _sampled({"json_object": True}, max_tokens=200),
                        use_tqdm=False)
    parsed = [o for o in outs if o.outputs[0].finish_reason == "stop"]
    assert parsed, "no json_object output finished"
    for o in parsed:
        assert isinstance(json.loads(o.outputs[0].text), dict)
    pattern = r"[a-c]{2,4}-\d{2}"
    for o in llm.generate(["x"] * 6, _sampled({"regex": pattern}), use_tqdm=False):
        assert re.fullmatch(pattern, o.outputs[0].text)
    choices = ["yes", "no", "maybe not"]
    for o in llm.generate(["x"] * 6, _sampled({"choice": choices}), use_tqdm=False):
        assert o.outputs[0].text in choices
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
    for o in llm.generate(["x"] * 6, _sampled({"grammar": grammar}, max_tokens=40),
                          use_tqdm=False):
        if o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"\(\d(\+\d)*\)", o.outputs[0].text)


def test_mixed_batch_leaves_free_requests_alone(llm):
    prompts = ["Once upon a time", "the café", "hello world", "to be or not"]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    mixed_params = [free, SamplingParams(temperature=1.0, seed=1, max_tokens=120,
                                         structured_outputs={"json": SCHEMA}),
                    free, SamplingParams(temperature=0.0, max_tokens=10,
                                         structured_outputs={"regex": r"\d{4}"})]
    outs = llm.generate(prompts, mixed_params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0]
    assert outs[2].outputs[0].token_ids == alone[2]
    jsonschema.validate(json.loads(outs[1].outputs[0].text), SCHEMA)
    assert re.fullmatch(r"\d{4}", outs[3].outputs[0].text)


def test_n_samples_each_valid(llm):
    out = llm.generate(["x"], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=60,
                                             structured_outputs={"json": SCHEMA}),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for comp in out.outputs:
        jsonschema.validate(json.loads(comp.text), SCHEMA)


@pytest.mark.parametrize("spec", [{"json": '{"type": "objec'}, {"regex": "a(b"},
                                  {"grammar": "root ::= ("}])
def test_invalid_spec_fails_alone(llm, spec):
    good = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(GenerateError) as info:
        llm.generate(["a", "b"], [good, SamplingParams(max_tokens=5, structured_outputs=spec)],
                     use_tqdm=False)
    assert 1 in info.value.errors and "structured_outputs: invalid" in info.value.errors[1]
    assert info.value.outputs[0].finished


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"json": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match="choice"):
        SamplingParams(structured_outputs={"choice": []})


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
def test_with_speculative_decoding(tiny_checkpoints, method):
    target = str(tiny_checkpoints["llama"])
    spec = ({"method": method, "num_speculative_tokens": 3} if method != "draft_model" else
            {"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=spec)
    # Repetitive prompts so the n-gram proposer drafts (and the grammar must trim them).
    prompt = '{"name": "ab", "age": 1, "tags": []} {"name": "ab", "age": 1, "tags": []}'
    outs = llm.generate([prompt] * 4, _sampled({"json": SCHEMA}, n=4), use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                   structured_outputs={"json": SCHEMA}),
                          use_tqdm=False)[0].outputs[0]
    plain = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                 structured_outputs={"json": SCHEMA}),
        use_tqdm=False)[0].outputs[0]
    assert greedy.token_ids == plain.token_ids
    assert llm.get_stats().spec_decoding_stats.num_draft_tokens > 0
