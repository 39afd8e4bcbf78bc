"""Logprob token strings in context and raw token bytes, on both tiny tokenizers (issue #17)."""

from __future__ import annotations

import pytest
import transformers

from pagedllm.core.sched_output import EngineCoreOutput, LogprobsLists
from pagedllm.engine.logprob_strings import ContextDecoder, TokenBytes, token_strings
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.entrypoints.openai.serving_chat import chat_logprobs
from pagedllm.entrypoints.openai.serving_completion import completion_logprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

TEXTS = [
    " The cat sees a red apple today.",
    "  two leading spaces,  then a double one",
    "café 🙂 naïve 日本語",
    "🚀",
    "The end 👍🏽",
]


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request, byte_level_tokenizer_dir, sentencepiece_tokenizer_dir):
    path = {"byte_level": byte_level_tokenizer_dir,
            "sentencepiece": sentencepiece_tokenizer_dir}[request.param]
    return transformers.AutoTokenizer.from_pretrained(path)


def _encode(tokenizer, text: str, bos: bool = False) -> list[int]:
    return tokenizer(text, add_special_tokens=bos).input_ids


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_token_strings_join_to_text(tokenizer, text: str) -> None:
    ids = _encode(tokenizer, text, bos=True)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<s>"
    strings = token_strings(tokenizer, ids)
    assert strings[0] == ""  # BOS adds nothing to the text
    assert "".join(strings) == text == _decode(tokenizer, ids)
    with_special = token_strings(tokenizer, ids, skip_special_tokens=False)
    assert "".join(with_special) == tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def test_sentencepiece_strings_keep_leading_spaces(sentencepiece_tokenizer_dir) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(sentencepiece_tokenizer_dir)
    prompt = _encode(tokenizer, "The cat", bos=True)
    output = _encode(tokenizer, " sees a red apple")
    decoder = ContextDecoder(tokenizer, prompt)
    strings = [decoder.add(t) for t in output]
    expected = _decode(tokenizer, prompt + output)[len(_decode(tokenizer, prompt)):]
    assert expected.endswith(" sees a red apple")  # (encoding alone prepends one more space)
    assert strings[0].startswith(" ") and "".join(strings) == expected
    # decoded alone, the first piece loses its space (the old behaviour)
    assert not tokenizer.decode([output[0]]).startswith(" ")


def test_alternatives_decode_in_context(tokenizer) -> None:
    prompt = _encode(tokenizer, "The cat", bos=True)
    decoder = ContextDecoder(tokenizer, prompt)
    alt = _encode(tokenizer, " sees")[0]
    expected = _decode(tokenizer, prompt + [alt])[len(_decode(tokenizer, prompt)):]
    assert decoder.alternative(alt) == expected and expected.startswith(" ")
    assert decoder.add(alt) == expected


def test_token_bytes_join_to_utf8(tokenizer) -> None:
    table = TokenBytes(tokenizer)
    for text in TEXTS:
        ids = _encode(tokenizer, text, bos=True)
        strings = token_strings(tokenizer, ids)
        raw = [table.get(t, s) for t, s in zip(ids, strings)]
        assert raw[0] == b""  # BOS: skipped in the text, so no bytes either
        joined = b"".join(raw)
        # SentencePiece's decoder strips the space it prepends to the first word; bytes keep it.
        if table.metaspace:
            joined = joined.removeprefix(b" ")
        assert joined == text.encode()
    emoji_ids = _encode(tokenizer, "🚀")
    emoji_bytes = [table.get(t, "") for t in emoji_ids
                   if tokenizer.convert_ids_to_tokens(t) != "▁"]
    assert len(emoji_bytes) > 1, "the emoji should be split over byte tokens"
    assert b"".join(emoji_bytes) == "🚀".encode()
    assert all(b != "\ufffd".encode() for b in emoji_bytes)


def _run(tokenizer, prompt_ids, output_ids, params, top_k=2, chunk=1):
    """Feed the output ids (and prompt logprobs) through an OutputProcessor; the top-k alternatives
    are the chosen id itself (rank 1) and the next vocabulary ids after it."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, prompt_ids, params)
    vocab = len(tokenizer)

    def lists(ids):
        alts = [[t] + [(t + j) % vocab for j in range(top_k)] for t in ids]
        return LogprobsLists(alts, [[-1.0] + [-1.0 - j for j in range(top_k)] for _ in ids],
                             [1] * len(ids))
    prompt_lists = lists(prompt_ids[1:])
    outs = []
    for i in range(0, len(output_ids), chunk):
        ids = output_ids[i:i + chunk]
        finished = i + chunk >= len(output_ids)
        outs.append(EngineCoreOutput(
            "r", ids, finish_reason="length" if finished else None, new_logprobs=lists(ids),
            new_prompt_logprobs=(1, prompt_lists) if i == 0 else None))
    [result], _ = processor.process_outputs(outs[:1])
    results = [result]
    for out in outs[1:]:
        results += processor.process_outputs([out])[0]
    return results[-1]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text_", TEXTS)
def test_offline_decoded_tokens_join_to_output_text(tokenizer, text_: str, chunk: int) -> None:
    prompt = _encode(tokenizer, "Hello:", bos=True)
    output = _encode(tokenizer, text_)
    params = SamplingParams(max_tokens=len(output), logprobs=2, prompt_logprobs=2,
                            output_kind=RequestOutputKind.CUMULATIVE)
    result = _run(tokenizer, prompt, output, params, chunk=chunk)
    completion = result.outputs[0]
    strings = [entry[t].decoded_token
               for t, entry in zip(completion.token_ids, completion.logprobs)]
    # (SentencePiece: encoding `text` alone prepends a space, which the output text keeps)
    text = _decode(tokenizer, prompt + output)[len(_decode(tokenizer, prompt)):]
    assert text.strip() == text_.strip()
    assert "".join(strings) == completion.text == text
    prompt_strings = token_strings(tokenizer, prompt)
    assert [entry[t].decoded_token for t, entry in
            zip(prompt[1:], result.prompt_logprobs[1:])] == prompt_strings[1:]

    table = TokenBytes(tokenizer)
    chat = chat_logprobs(completion.token_ids, completion.logprobs, 2, table)
    assert b"".join(bytes(t.bytes) for t in chat.content) == text.encode()
    for t in chat.content:
        assert t.top_logprobs[0].bytes == t.bytes  # rank 1 is the chosen token here
    assert not any(t.bytes == list("\ufffd".encode()) for t in chat.content)

    comp = completion_logprobs(completion.token_ids, completion.logprobs, 2, 0)
    assert "".join(comp.tokens) == text
    assert [text[o:o + len(t)] for o, t in zip(comp.text_offset, comp.tokens)] == comp.tokens


def test_echo_logprobs_with_bos(tokenizer) -> None:
    """Echo: prompt strings (BOS = "") then output strings join to prompt text + output text."""
    prompt_text, output_text = "  Echo me 🙂", " and more"
    prompt = _encode(tokenizer, prompt_text, bos=True)
    output = _encode(tokenizer, output_text)
    params = SamplingParams(max_tokens=len(output), logprobs=1, prompt_logprobs=1)
    assert "".join(token_strings(tokenizer, prompt)) == prompt_text
    result = _run(tokenizer, prompt, output, params, top_k=1)
    completion = result.outputs[0]
    part = completion_logprobs(prompt, result.prompt_logprobs, 1, 0,
                               tokens=token_strings(tokenizer, prompt))
    offset = part.text_offset[-1] + len(part.tokens[-1])
    full = completion_logprobs(completion.token_ids, completion.logprobs, 1, offset, part)
    text = prompt_text + completion.text
    assert full.tokens[0] == "" and full.token_logprobs[0] is None
    assert "".join(full.tokens) == text
    assert [text[o:o + len(t)] for o, t in zip(full.text_offset, full.tokens)] == full.tokens


def test_unfinished_character_at_the_end_goes_to_last_token(tokenizer) -> None:
    prompt = _encode(tokenizer, "Hi", bos=True)
    output = _encode(tokenizer, " 🚀")[:-1]  # stop inside the emoji's bytes
    params = SamplingParams(max_tokens=len(output), logprobs=0)
    completion = _run(tokenizer, prompt, output, params, top_k=0).outputs[0]
    strings = [entry[t].decoded_token
               for t, entry in zip(completion.token_ids, completion.logprobs)]
    assert "".join(strings) == completion.text and completion.text.endswith("\ufffd")
