"""OutputProcessor: the text of the stop token that ended a request in the core (EOS or one of
`stop_token_ids`) is left out of the output (a `stop_token_ids` hit's is kept with
include_stop_str_in_output); the id stays in token_ids and its logprobs are unchanged. Fed
EngineCoreOutputs as the scheduler makes them: several tokens in one step (a multi-step round,
accepted drafts) with the stop token last."""

from __future__ import annotations

import pytest
import transformers

from pagedllm.core.sched_output import EngineCoreOutput, LogprobsLists
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request, byte_level_tokenizer_dir, sentencepiece_tokenizer_dir):
    path = {"byte_level": byte_level_tokenizer_dir,
            "sentencepiece": sentencepiece_tokenizer_dir}[request.param]
    return transformers.AutoTokenizer.from_pretrained(path)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _text_after(tokenizer, prompt: list[int], ids: list[int]) -> str:
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
    return decode(prompt + ids)[len(decode(prompt)):]


def _steps(ids: list[int], sizes: list[int]) -> list[list[int]]:
    steps, i = [], 0
    for size in sizes:
        steps.append(ids[i:i + size])
        i += size
    assert i == len(ids)
    return steps


def _logprobs(ids: list[int]) -> LogprobsLists:
    return LogprobsLists([[t] for t in ids], [[-0.5] for _ in ids], [1] * len(ids))


def _run(tokenizer, prompt, ids, params, sizes, finish_reason, stop_reason, n: int = 1):
    """Feed `ids` in steps of `sizes` (the last step finishes every child with `finish_reason`,
    `stop_reason`); returns every RequestOutput."""
    processor = OutputProcessor(tokenizer)
    parent = ParentRequest("p", None, prompt, n, params.output_kind) if n > 1 else None
    req_ids = [f"{i}_p" for i in range(n)] if n > 1 else ["p"]
    for i, req_id in enumerate(req_ids):
        processor.add_request(req_id, None, prompt, params, parent, i)
    steps = _steps(ids, sizes)
    results = []
    for k, step in enumerate(steps):
        last = k == len(steps) - 1
        outs = [EngineCoreOutput(req_id, step, finish_reason=finish_reason if last else None,
                                 stop_reason=stop_reason if last else None,
                                 new_logprobs=_logprobs(step)) for req_id in req_ids]
        request_outputs, to_abort = processor.process_outputs(outs)
        assert to_abort == []
        results += request_outputs
    assert not processor.has_unfinished_requests()
    return results


KINDS = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("sizes", [[1] * 6, [2, 4], [6]])
@pytest.mark.parametrize("stop", [[], ["zzz"]])
def test_stop_token_text_follows_include_stop_str(tokenizer, kind, include, sizes, stop):
    prompt = _encode(tokenizer, "Hello:")
    ids = _encode(tokenizer, " a red apple today and then")[:5] + _encode(tokenizer, " not")[-1:]
    stop_id = ids[-1]
    params = SamplingParams(temperature=0.0, stop_token_ids=[stop_id], stop=stop,
                            include_stop_str_in_output=include, output_kind=kind, logprobs=0)
    results = _run(tokenizer, prompt, ids, params, sizes, "stop", stop_id)
    expected = _text_after(tokenizer, prompt, ids if include else ids[:-1])
    assert expected != _text_after(tokenizer, prompt, ids[:-1] if include else ids)
    outs = [r.outputs[0] for r in results]
    if kind == RequestOutputKind.DELTA:
        text, token_ids = "".join(o.text for o in outs), [t for o in outs for t in o.token_ids]
        logprobs = [lp for o in outs for lp in o.logprobs]
    else:
        text, token_ids, logprobs = outs[-1].text, outs[-1].token_ids, outs[-1].logprobs
        # Streamed (cumulative) texts only grow, each a prefix of the final one.
        assert all(expected.startswith(o.text) for o in outs)
    assert text == expected and token_ids == ids
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_id
    # The stop token keeps its logprob entry, with its own text.
    assert len(logprobs) == len(ids) and logprobs[-1][stop_id].logprob == -0.5
    assert logprobs[-1][stop_id].decoded_token == tokenizer.decode(
        ids, skip_special_tokens=True)[len(tokenizer.decode(ids[:-1],
                                                            skip_special_tokens=True)):]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("sizes", [[1] * 5, [4, 1], [5]])
def test_eos_text_never_in_output(tokenizer, kind, include, sizes):
    """skip_special_tokens=False: an EOS that ended the request (stop_reason None) is never text,
    also with include_stop_str_in_output, and for every child of n > 1."""
    prompt = _encode(tokenizer, "Hello:")
    ids = _encode(tokenizer, " a red apple today")[:4] + [tokenizer.eos_token_id]
    params = SamplingParams(temperature=0.0, skip_special_tokens=False, n=2,
                            include_stop_str_in_output=include, output_kind=kind)
    results = _run(tokenizer, prompt, ids, params, sizes, "stop", None, n=2)
    expected = _text_after(tokenizer, prompt, ids[:-1])
    assert tokenizer.eos_token not in expected
    assert results[-1].finished and len(results[-1].outputs) == (
        1 if kind == RequestOutputKind.DELTA else 2)
    for index in (0, 1):
        outs = [o for r in results for o in r.outputs if o.index == index]
        if kind == RequestOutputKind.DELTA:
            text, token_ids = "".join(o.text for o in outs), [t for o in outs for t in o.token_ids]
        else:
            text, token_ids = outs[-1].text, outs[-1].token_ids
        assert text == expected and token_ids == ids
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None


def test_other_finish_reasons_keep_the_last_token_text(tokenizer):
    """Only a stop token loses its text: at max_tokens (or a core error) the last token's text,
    an EOS's included (ignore_eos with skip_special_tokens=False), stays."""
    prompt = _encode(tokenizer, "Hello:")
    ids = _encode(tokenizer, " a red apple")[:3] + [tokenizer.eos_token_id]
    params = SamplingParams(temperature=0.0, skip_special_tokens=False, ignore_eos=True)
    for finish_reason in ("length", "abort"):
        [*_, result] = _run(tokenizer, prompt, ids, params, [2, 2], finish_reason, None)
        assert result.outputs[0].text == _text_after(tokenizer, prompt, ids)
        assert result.outputs[0].text.endswith(tokenizer.eos_token)


def test_stop_string_before_the_stop_token_ends_the_text(tokenizer):
    """A stop string completed by a token before the stop token (same step) finishes the request
    there: stop_reason the string, token_ids up to the token that completed it."""
    prompt = _encode(tokenizer, "Hello:")
    ids = _encode(tokenizer, " a red apple today")
    red_end = next(n for n in range(1, len(ids) + 1)
                   if "red" in tokenizer.decode(ids[:n], skip_special_tokens=True))
    assert red_end < len(ids)
    params = SamplingParams(temperature=0.0, stop=["red"], stop_token_ids=[ids[-1]])
    [*_, result] = _run(tokenizer, prompt, ids, params, [len(ids)], "stop", ids[-1])
    out = result.outputs[0]
    assert out.stop_reason == "red" and out.token_ids == ids[:red_end]
    assert out.text == _text_after(tokenizer, prompt, ids[:red_end]).split("red")[0]
