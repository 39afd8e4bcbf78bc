"""IncrementalDetokenizer against `tokenizer.decode` on both tiny tokenizers, plus stop strings."""

from __future__ import annotations

import random

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.detokenizer import IncrementalDetokenizer, backend_decode

TEXTS = [
    "The cat sees a red apple today.",
    "café naïve résumé, crème brûlée!",
    "日本語 and 東京 🙂🚀 done",
    "  two leading spaces,  then a double one",
    "🇯🇵👍🏽 emoji sequences → arrows €5",
]


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request, byte_level_tokenizer_dir, sentencepiece_tokenizer_dir):
    path = {"byte_level": byte_level_tokenizer_dir, "sentencepiece": sentencepiece_tokenizer_dir}[request.param]
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def sp_tokenizer(sentencepiece_tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(sentencepiece_tokenizer_dir)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes) -> tuple[list[str], str | None]:
    """Feed `ids` in chunks; return the streamed deltas (the last one at finish) and the stop match."""
    deltas, stop, i = [], None, 0
    for size in chunk_sizes:
        if i >= len(ids) or stop is not None:
            break
        stop = detok.update(ids[i : i + size])
        i += size
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stop


def _random_chunks(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1, 4) for _ in range(n)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_matches_decode_on_random_ids(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    vocab_size = len(tokenizer)
    for _ in range(400):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 24))]
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
        deltas, _ = _stream(detok, ids, _random_chunks(rng, len(ids)))
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == expected, tokenizer.convert_ids_to_tokens(ids)
        assert "".join(deltas) == expected
        assert detok.token_ids == ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_matches_decode_after_prompt_on_random_ids(tokenizer, skip_special_tokens):
    rng = random.Random(99)
    vocab_size = len(tokenizer)
    checked = 0
    for _ in range(400):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 16))]
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
        full_text = tokenizer.decode(prompt + ids, skip_special_tokens=skip_special_tokens)
        if prompt_text.endswith("\ufffd") or not full_text.startswith(prompt_text):
            continue  # the prompt ends inside a character: "text after the prompt" is ill-defined
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        deltas, _ = _stream(detok, ids, _random_chunks(rng, len(ids)))
        assert detok.output_text == full_text[len(prompt_text) :], tokenizer.convert_ids_to_tokens(prompt + ids)
        assert "".join(deltas) == detok.output_text
        checked += 1
    assert checked > 200


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_matches_decode_hypothesis(sp_tokenizer, data):
    """Byte-fallback runs are where windowed decoding can go wrong; let hypothesis shrink failures."""
    byte_ids = sp_tokenizer.convert_tokens_to_ids(["<0x41>", "<0xE6>", "<0x97>", "<0xA5>", "<0x80>", "<0xF0>"])
    other_ids = [0, 1, 2] + sp_tokenizer.convert_tokens_to_ids(["▁", "a", "▁the", "é"])
    ids = data.draw(st.lists(st.sampled_from(byte_ids + other_ids), min_size=1, max_size=16))
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(sp_tokenizer, [], skip_special_tokens=skip)
    deltas, _ = _stream(detok, ids, chunks)
    assert detok.output_text == sp_tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text


@pytest.mark.parametrize("text", TEXTS)
def test_streams_text_without_partial_characters(tokenizer, text):
    prompt = tokenizer("Anna writes:").input_ids
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, _ = _stream(detok, ids, [1] * len(ids))
    expected = tokenizer.decode(prompt + ids, skip_special_tokens=True)[len("Anna writes:") :]
    assert detok.output_text == expected
    assert all("\ufffd" not in delta for delta in deltas), deltas
    assert "".join(deltas) == expected


def test_multi_byte_character_is_held_until_complete(tokenizer):
    ids = _encode(tokenizer, "a日")
    detok = IncrementalDetokenizer(tokenizer, [])
    outputs = []
    for token_id in ids:
        detok.update([token_id])
        outputs.append(detok.output_text)
    assert len(ids) >= 3  # "日" takes several tokens in both tokenizers
    assert all(text in ("", "a") for text in outputs[:-1])
    assert detok.get_next_output_text(finished=True, delta=False) == "a日"


def test_incomplete_character_at_finish_is_emitted_as_decoded(tokenizer):
    ids = _encode(tokenizer, "x日")[:-1]  # drop the last byte of "日"
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(ids)
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=False)
    final = detok.get_next_output_text(finished=True, delta=False)
    assert final == tokenizer.decode(ids) and final.endswith("\ufffd")


def test_sentencepiece_first_token_keeps_leading_space(sp_tokenizer):
    prompt = sp_tokenizer("The cat").input_ids
    full = sp_tokenizer("The cat sees a red apple").input_ids
    output = full[len(prompt) :]
    assert full[: len(prompt)] == prompt
    assert sp_tokenizer.convert_ids_to_tokens(output[0]).startswith("▁")

    detok = IncrementalDetokenizer(sp_tokenizer, prompt)
    detok.update(output[:1])
    first = detok.get_next_output_text(finished=False, delta=True)
    assert first.startswith(" ")
    detok.update(output[1:])
    assert detok.get_next_output_text(finished=True, delta=False) == " sees a red apple"

    # Without a prompt the first space is stripped, exactly as decode(output) does.
    detok = IncrementalDetokenizer(sp_tokenizer, [])
    detok.update(output)
    assert detok.get_next_output_text(finished=True, delta=False) == sp_tokenizer.decode(output)
    assert not detok.output_text.startswith(" ")


def test_prompt_ending_in_skipped_special_tokens_keeps_leading_space(sp_tokenizer):
    eos = sp_tokenizer.eos_token_id
    prompt = sp_tokenizer("The cat").input_ids + [eos] * 8
    output = _encode(sp_tokenizer, "sees it")
    detok = IncrementalDetokenizer(sp_tokenizer, prompt)
    detok.update(output)
    detok.get_next_output_text(finished=True, delta=False)
    expected = sp_tokenizer.decode(prompt + output, skip_special_tokens=True)[len("The cat") :]
    assert detok.output_text == expected == " sees it"


def test_cjk_output_continuing_a_byte_run_in_the_prompt(sp_tokenizer):
    ids = _encode(sp_tokenizer, "x 日本語日本語")
    prompt, output = ids[:-3], ids[-3:]  # the prompt tail is 8+ byte tokens of one run
    detok = IncrementalDetokenizer(sp_tokenizer, prompt)
    detok.update(output)
    assert detok.get_next_output_text(finished=True, delta=False) == "語"


def test_stop_string_spanning_tokens_and_update_boundary(tokenizer):
    text = "The cat sees a red apple today."
    ids = _encode(tokenizer, text)
    for chunk in (1, 2, 3, len(ids)):
        detok = IncrementalDetokenizer(tokenizer, [], stop=["red apple"])
        deltas, stop = _stream(detok, ids, [chunk] * len(ids))
        assert stop == "red apple"
        assert detok.output_text == "The cat sees a "
        assert "".join(deltas) == "The cat sees a "


def test_include_stop_str_in_output(tokenizer):
    ids = _encode(tokenizer, "The cat sees a red apple today.")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["red"], include_stop_str_in_output=True)
    _, stop = _stream(detok, ids, [1] * len(ids))
    assert stop == "red"
    assert detok.output_text == "The cat sees a red"


def test_first_completed_stop_string_wins(tokenizer):
    ids = _encode(tokenizer, "The cat sees a red apple today.")
    for chunk in (1, len(ids)):
        # "a red apple" starts earlier but "red" completes first.
        detok = IncrementalDetokenizer(tokenizer, [], stop=["a red apple", "today", "red"])
        _, stop = _stream(detok, ids, [chunk] * len(ids))
        assert (stop, detok.output_text) == ("red", "The cat sees a ")
        # Same end: the longer match wins.
        detok = IncrementalDetokenizer(tokenizer, [], stop=["apple", "red apple"])
        _, stop = _stream(detok, ids, [chunk] * len(ids))
        assert (stop, detok.output_text) == ("red apple", "The cat sees a ")


def test_stop_string_with_multi_byte_characters(tokenizer):
    ids = _encode(tokenizer, "café 日本語 🙂 done")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["本語 🙂"], include_stop_str_in_output=True)
    _, stop = _stream(detok, ids, [1] * len(ids))
    assert stop == "本語 🙂"
    assert detok.output_text == "café 日本語 🙂"


def test_stop_string_is_never_streamed(tokenizer):
    rng = random.Random(7)
    text = "Anna paints the garden near the sea, then the last train comes."
    ids = _encode(tokenizer, text)
    for _ in range(50):
        start = rng.randrange(len(text) - 4)
        stop_str = text[start : start + rng.randint(2, 12)]
        if not stop_str.strip():
            continue
        detok = IncrementalDetokenizer(tokenizer, [], stop=[stop_str, "zz-never-zz"])
        streamed = ""
        for token_id in ids:
            stop = detok.update([token_id])
            streamed += detok.get_next_output_text(finished=stop is not None, delta=True)
            assert stop_str not in streamed or stop is not None
            if stop is not None:
                break
        assert stop == stop_str
        assert streamed == detok.output_text == text[: text.find(stop_str)]


def test_random_stop_strings_match_reference(tokenizer):
    rng = random.Random(5)
    for _ in range(150):
        text = rng.choice(TEXTS)
        ids = _encode(tokenizer, text)
        stops = [text[a : a + rng.randint(1, 6)] for a in rng.sample(range(len(text)), 3)]
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop_str_in_output=include)
        deltas, stop = _stream(detok, ids, _random_chunks(rng, len(ids)))
        end, neg_start, expected_stop = min((text.find(s) + len(s), -len(s), s) for s in stops)
        assert stop == expected_stop
        assert detok.output_text == text[: end if include else end + neg_start]
        assert "".join(deltas) == detok.output_text


def test_stop_string_in_prompt_is_ignored(tokenizer):
    prompt = tokenizer("The red apple").input_ids
    output = _encode(tokenizer, "sees")
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["apple", "red"])
    assert detok.update(output) is None
    expected = tokenizer.decode(prompt + output, skip_special_tokens=True)[len("The red apple") :]
    assert detok.get_next_output_text(finished=True, delta=False) == expected
    assert expected.endswith("sees")


def test_stop_string_found_when_flushing_at_finish(tokenizer):
    ids = _encode(tokenizer, "ab日")[:-1]  # ends with an incomplete character, held until finish
    detok = IncrementalDetokenizer(tokenizer, [], stop=["b\ufffd"])
    assert detok.update(ids) is None
    assert detok.get_next_output_text(finished=True, delta=False) == "a"


def test_hold_back_and_delta_bookkeeping(tokenizer):
    ids = _encode(tokenizer, "The cat sees a red apple")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["xyzw"])  # holds back 3 characters
    detok.update(ids)
    assert detok.get_next_output_text(finished=False, delta=False) == "The cat sees a red ap"
    assert detok.get_next_output_text(finished=False, delta=True) == "The cat sees a red ap"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "ple"
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=False) == "The cat sees a red apple"


def test_errors(tokenizer):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, [], stop=["ok", ""])
    detok = IncrementalDetokenizer(tokenizer, [], stop="red")  # a bare str is one stop string
    assert detok.update(_encode(tokenizer, "a red apple")) == "red"
    assert detok.update([]) is None
    with pytest.raises(RuntimeError):
        detok.update([5])
    finished = IncrementalDetokenizer(tokenizer, [])
    finished.update([5])
    finished.get_next_output_text(finished=True, delta=False)
    with pytest.raises(RuntimeError):
        finished.update([6])


class _RecordingTokenizer:
    """Forwards to a real tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.decode_lengths.append(len(token_ids))
        return self._tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_decodes_a_bounded_window_per_step(tokenizer):
    text = " ".join(TEXTS * 8)
    ids = _encode(tokenizer, text)
    recording = _RecordingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(recording, tokenizer("A long prompt " * 50).input_ids, stop=["zzz"])
    for token_id in ids:
        detok.update([token_id])
    assert len(ids) > 300
    assert max(recording.decode_lengths) <= 20
    assert len(recording.decode_lengths) <= 2 * len(ids) + 4
    assert detok.get_next_output_text(finished=True, delta=False).strip() == text.strip()


def test_min_tokens_holds_back_stop_strings(tokenizer):
    """A stop string completed by one of the first min_tokens tokens does not end the request;
    the first one completed after them does."""
    ids = _encode(tokenizer, "a\nb\nc\nd\ne\nf\n")
    reference = IncrementalDetokenizer(tokenizer, [], stop=["\n"])
    _, stop = _stream(reference, ids, [1] * len(ids))
    assert stop == "\n" and reference.output_text == "a"
    for min_tokens in (3, 6):
        detok = IncrementalDetokenizer(tokenizer, [], stop=["\n"], min_tokens=min_tokens)
        _, stop = _stream(detok, ids, [1] * len(ids))
        assert stop == "\n"
        # It ran past min_tokens tokens; the newlines before are kept in the text.
        assert len(detok.token_ids) > min_tokens
        assert detok.output_text.startswith("a\nb") and not detok.output_text.endswith("\n")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_only_with_include_stop_str(tokenizer, include):
    """The stop token that ended the request in the core stays in token_ids; its text is in the
    output only with include_stop_str_in_output (vLLM's `update(ids, stop_terminated)`)."""
    prompt = _encode(tokenizer, "Hello:")
    ids = _encode(tokenizer, "a red apple today")
    without, with_stop = (_decode_after(tokenizer, prompt, ids[:n]) for n in (-1, None))
    assert without != with_stop
    for chunk in (1, 3, len(ids)):
        detok = IncrementalDetokenizer(tokenizer, prompt, include_stop_str_in_output=include)
        deltas = []
        for i in range(0, len(ids), chunk):
            last = i + chunk >= len(ids)
            assert detok.update(ids[i : i + chunk], stop_terminated=last) is None
            deltas.append(detok.get_next_output_text(finished=last, delta=True))
        assert detok.token_ids == ids
        assert "".join(deltas) == detok.output_text == (with_stop if include else without)
        with pytest.raises(RuntimeError):
            detok.update([ids[0]])


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_never_in_the_output(tokenizer, include):
    """An EOS that ended the request is not text even with skip_special_tokens=False."""
    ids = _encode(tokenizer, "a red apple") + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith(tokenizer.eos_token)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False,
                                   include_stop_str_in_output=include)
    detok.update(ids, stop_terminated=True, eos=True)
    text = detok.get_next_output_text(finished=True, delta=False)
    assert text == tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert tokenizer.eos_token not in text and detok.token_ids == ids
    # Alone in its step (the usual case without multi-step rounds): nothing is added.
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    detok.update(ids[:-1])
    before = detok.get_next_output_text(finished=False, delta=False)
    detok.update(ids[-1:], stop_terminated=True, eos=True)
    assert detok.get_next_output_text(finished=True, delta=False) == before == text


def test_stop_string_before_a_stop_token_wins(tokenizer):
    """A stop string completed by the tokens before the stop token ends the text there; one
    inside the stop token's own text matches only when that text is kept."""
    ids = _encode(tokenizer, "a red apple")
    red_end = next(n for n in range(1, len(ids) + 1)
                   if "red" in tokenizer.decode(ids[:n], skip_special_tokens=True))
    assert red_end < len(ids)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["red"])
    assert detok.update(ids, stop_terminated=True) == "red"
    assert detok.output_text == "a "
    stop_str = tokenizer.decode(ids[-1:]).strip()
    for include in (False, True):
        detok = IncrementalDetokenizer(tokenizer, [], stop=[stop_str],
                                       include_stop_str_in_output=include)
        matched = detok.update(ids, stop_terminated=True)
        assert matched == (stop_str if include else None)
        assert detok.get_next_output_text(finished=True, delta=False) == (
            tokenizer.decode(ids) if include else tokenizer.decode(ids[:-1]))


def _decode_after(tokenizer, prompt: list[int], ids: list[int]) -> str:
    return tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_equals_transformers_decode(tokenizer, skip_special_tokens):
    """The front end decodes through the tokenizers backend directly (backend_decode); a wrapper
    that hides the backend takes transformers' `decode`: streams and final texts are equal."""
    assert backend_decode(tokenizer) is not None
    assert backend_decode(_RecordingTokenizer(tokenizer)) is None
    rng = random.Random(7)
    vocab_size = len(tokenizer)
    for _ in range(200):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 10))]
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 16))]
        chunks = _random_chunks(rng, len(ids))
        streams = []
        for tok in (tokenizer, _RecordingTokenizer(tokenizer)):
            detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens,
                                           stop=["e t"])
            streams.append((_stream(detok, ids, chunks), detok.output_text, detok.token_ids))
        assert streams[0] == streams[1]
