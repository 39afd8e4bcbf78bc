"""The shipped model (`LLM()`): a stop token's text is in the output only with
include_stop_str_in_output; an EOS is never text, also with skip_special_tokens=False. The ids
stay in token_ids. Greedy, "ROMEO:" continues as "\\nI'll be not, I'll be not,". The default CPU
engine delivers the tokens in multi-step rounds; with the n-gram drafter a stop token arrives
with an accepted draft in one step."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPT = "ROMEO:"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def not_id(llm: LLM) -> int:
    [token_id] = llm.get_tokenizer()(" not", add_special_tokens=False).input_ids
    return token_id


def _generate(llm: LLM, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=32, **kwargs)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_follows_include_stop_str(llm, not_id, include):
    free = _generate(llm, ignore_eos=True)
    first = free.token_ids.index(not_id)
    tokenizer = llm.get_tokenizer()
    expected = tokenizer.decode(free.token_ids[:first + include], skip_special_tokens=True)
    out = _generate(llm, stop_token_ids=[not_id], include_stop_str_in_output=include)
    assert out.token_ids == free.token_ids[:first + 1] and out.token_ids[-1] == not_id
    assert out.finish_reason == "stop" and out.stop_reason == not_id
    assert out.text.endswith(" not") == include and out.text == expected
    # With min_tokens=6 the first " not" may not be sampled (it is masked): the output goes
    # "\nI'll be a man, I'll be not". With the n-gram drafter " be" is an accepted draft and
    # " not" arrives with it in one step.
    outs = []
    for engine in (llm, LLM(kv_cache_memory_bytes=16 << 20, speculative_config=NGRAM)):
        out = _generate(engine, stop_token_ids=[not_id], min_tokens=6,
                        include_stop_str_in_output=include)
        assert out.token_ids[-1] == not_id and len(out.token_ids) > 6
        assert out.finish_reason == "stop" and out.stop_reason == not_id
        assert out.text == tokenizer.decode(out.token_ids[:len(out.token_ids) - 1 + include])
        assert out.text.endswith(" not") == include
        outs.append(out)
    assert outs[0].token_ids == outs[1].token_ids and outs[0].text == outs[1].text
    assert engine.get_stats().spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("include", [False, True])
def test_eos_is_never_text(llm, include):
    """EOS made certain after min_tokens (logit_bias), skip_special_tokens=False."""
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=32, skip_special_tokens=False,
                            ignore_eos=False, min_tokens=3, logit_bias={eos: 100},
                            include_stop_str_in_output=include, n=2)
    [result] = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(result.outputs) == 2
    for out in result.outputs:
        assert len(out.token_ids) == 4 and out.token_ids[-1] == eos
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert "</s>" not in out.text and out.text.strip()
        assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1])
