"""Incremental detokenization and stop strings for one request (front-end process, once per step).

Owns a request's generated text: each step decodes only a short window of token ids, holds back
text that later tokens may still change (an incomplete UTF-8 character, an open run of byte-fallback
tokens), searches only the new tail for stop strings, and holds back a possible stop-string prefix
from streamed output. It never re-decodes the whole sequence and never touches the scheduler or
model tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

# Prompt tokens decoded in front of the first generated token, so decoders that treat the first
# token specially (SentencePiece's leading-space strip) decode the output as they would after the
# full prompt. Same value as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5

# A byte-fallback token as tokenizers' ByteFallback decoder recognises it (Llama 2, Mistral).
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT_CHAR = "\ufffd"


def backend_decode(tokenizer) -> Callable[[list[int], bool], str] | None:
    """`tokenizers.Tokenizer.decode(ids, skip_special_tokens)` of a fast (tokenizers-backed)
    transformers tokenizer whose `decode` (and `convert_ids_to_tokens`) is transformers' own, else
    None.

    For such a tokenizer `tokenizer.decode(ids, skip_special_tokens=s,
    clean_up_tokenization_spaces=False)` is exactly that call (transformers 5's
    `TokenizersBackend._decode`; `spaces_between_special_tokens` is ignored there) after
    argument conversions that cost about three times the decode itself (17 us in all against
    4 us for a few ids): the incremental detokenizer decodes twice per request and step, so the
    front end calls the backend directly.
    """
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode
            and cls.convert_ids_to_tokens is TokenizersBackend.convert_ids_to_tokens):
        return None
    backend = tokenizer.backend_tokenizer
    return lambda ids, skip_special_tokens: backend.decode(
        ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Generated text of one request, extended step by step, with stop strings applied.

    Algorithm: vLLM's `detokenize_incrementally` (vllm/transformers_utils/detokenizer_utils.py,
    itself after Hugging Face TGI's `decode_token`; tokenizers' `DecodeStream` is the same scheme)::

        ids   = [ prompt tail ... | generated ids ................... ]
                          prefix_offset ^      read_offset ^      end ^
        prefix_text = decode(ids[prefix_offset:read_offset])
        new_text    = decode(ids[prefix_offset:])[len(prefix_text):]

    `new_text` is appended to `output_text` and both offsets advance (prefix_offset = read_offset,
    read_offset = end) unless it is empty, ends in U+FFFD (a UTF-8 character split over tokens,
    whose remaining bytes may come next), or the last decoded token is a byte-fallback token
    `<0xXX>`: tokenizers' ByteFallback decoder turns a whole run of byte tokens into U+FFFDs when
    any byte of it is invalid, so a run's text is final only once a non-byte token closes it.
    Held tokens are decoded again with the next ones; `get_next_output_text(finished=True)` appends
    them as decoded (U+FFFD included). Decoding the window from `prefix_offset`, not from
    `read_offset`, keeps first-token effects out of the output: SentencePiece's leading space on
    the first generated token survives, as in `decode(prompt + output)`.

    Stop tokens: the token that ended the request in the core (EOS, or one of `stop_token_ids`;
    `update(..., stop_terminated=True)`) goes into `token_ids`, but its text goes into
    `output_text` only for a `stop_token_ids` hit with `include_stop_str_in_output`; an EOS's
    text never does (so `skip_special_tokens=False` never yields "</s>"). As vLLM's
    `IncrementalDetokenizer.update(new_token_ids, stop_terminated)`, except that vLLM keeps the
    EOS's text too under `include_stop_str_in_output`.

    Invariants:
    - `token_ids` holds every generated id passed to `update`, including those after a stop string
      and a stop token whose text was left out.
    - Without a stop string, after `get_next_output_text(finished=True)`, `output_text` equals
      `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` for an
      empty prompt, where `ids` is `token_ids` less a left-out stop token; after a prompt it
      equals the text that `decode(prompt + ids)` adds to `decode(prompt)`. (A character whose
      bytes straddle the prompt's end belongs to the output.)
    - `output_text` only grows, except for the one cut at a matched stop string.
    - Streamed text (`get_next_output_text`) is always a prefix of the final `output_text`.

    Stop strings: the match that completes first in the text wins (ties: the longer one), so the
    result does not depend on how tokens were grouped into `update` calls. `output_text` is cut
    before the match, or after it when `include_stop_str_in_output`. As in vLLM, text is never
    cleaned up (`clean_up_tokenization_spaces=False`) and `spaces_between_special_tokens` is just
    forwarded to `tokenizer.decode` (transformers 5 ignores it).

    Raises ValueError for an empty stop string.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty str, got {stop!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        # Stop strings are looked for only in text that tokens after the first `min_tokens`
        # complete (as vLLM): the request may not end before it has min_tokens tokens.
        self.min_tokens = min_tokens
        # Streamed output lags `output_text` by this much, so a stop string is never streamed.
        self.stop_buffer_length = max((len(s) for s in stop), default=1) - 1

        self.output_text = ""
        self.token_ids: list[int] = []
        self._stopped = False
        self._stop_terminated = False
        self._finished = False
        self._last_output_text_offset = 0
        self._special_ids: set[int] | None = None  # built on first need
        # The backend's decode where it is transformers' decode exactly (see backend_decode).
        self._backend_decode = backend_decode(tokenizer)
        self._id_to_token = (tokenizer.backend_tokenizer.id_to_token
                             if self._backend_decode is not None else None)

        # ids[prefix_offset:] of the diagram above; `_read_offset` is relative to its start.
        self._window_ids = self._prompt_context(list(prompt_token_ids))
        self._read_offset = len(self._window_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False, *,
               eos: bool = False) -> str | None:
        """Append newly generated tokens; return the stop string that matched, else None.

        On a match `output_text` is cut before the stop string (or just after it with
        `include_stop_str_in_output`) and the request's text is final. An empty `new_token_ids` is
        a no-op.

        Args:
            stop_terminated: the last id is the stop token that ended the request in the core
                (the scheduler's finish_reason "stop"). It is appended to `token_ids`; its text
                is decoded only if it is one of `stop_token_ids` (`eos=False`) and
                `include_stop_str_in_output`.
            eos: that stop token is an EOS (stop_reason None), whose text is never decoded.

        Raises:
            RuntimeError: if tokens arrive after a stop string matched, after a stop token, or
                after `get_next_output_text(finished=True)`.
        """
        if not new_token_ids:
            return None
        if self._stopped or self._stop_terminated or self._finished:
            raise RuntimeError("update() after the request's text was finished")
        skip_last = stop_terminated and (eos or not self.include_stop_str_in_output)
        decoded_ids = new_token_ids[:-1] if skip_last else new_token_ids
        self.token_ids.extend(decoded_ids)
        self._window_ids.extend(decoded_ids)
        num_chars_before = len(self.output_text)
        self._decode_window(flush=False)
        stop_str = self._check_stop(num_chars_before)
        if skip_last:
            self.token_ids.append(new_token_ids[-1])
        self._stop_terminated = stop_terminated
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to emit now: all of it (`delta=False`) or only what is new since the last call.

        Unless `finished` (or a stop string matched), the last `stop_buffer_length` characters
        are held back, since they may begin a stop string completed by a later step. The first
        call with `finished=True` appends held tokens as decoded (and applies stop strings to
        them); later calls return the same full text, or "" for `delta=True`.
        """
        if finished and not self._finished:
            self._finished = True
            if not self._stopped:
                num_chars_before = len(self.output_text)
                self._decode_window(flush=True)
                self._check_stop(num_chars_before)
        held = 0 if (finished or self._stopped) else self.stop_buffer_length
        length = max(len(self.output_text) - held, 0)
        if not delta:
            return self.output_text[:length]
        start = self._last_output_text_offset
        if length <= start:
            return ""
        self._last_output_text_offset = length
        return self.output_text[start:length]

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt tail decoded in front of the output: its last few tokens, widened so it does
        not start inside a byte-fallback run and (if it decodes to "") so it has some text."""
        start = max(len(prompt_token_ids) - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        while (
            start > 0
            and self._is_byte_token(prompt_token_ids[start])
            and self._is_byte_token(prompt_token_ids[start - 1])
        ):
            start -= 1
        width = len(prompt_token_ids) - start
        while start > 0 and not self._decode(prompt_token_ids[start:]):
            width *= 2
            start = max(len(prompt_token_ids) - width, 0)
        return prompt_token_ids[start:]

    def _decode_window(self, flush: bool) -> None:
        """Append the text of ids[read_offset:] if final (always if `flush`) and advance."""
        if self._read_offset == len(self._window_ids):
            return
        prefix_text = self._decode(self._window_ids[: self._read_offset])
        full_text = self._decode(self._window_ids)
        if full_text.startswith(prefix_text):
            new_text = full_text[len(prefix_text) :]
        else:
            # NOTE(detok): only when the prompt ends inside a UTF-8 character or byte run that the
            # output completes; the completed character is then part of the output.
            new_text = full_text[_common_prefix_length(prefix_text, full_text) :]
        if not flush and (
            not new_text or new_text.endswith(_REPLACEMENT_CHAR) or self._byte_run_is_open()
        ):
            return
        self.output_text += new_text
        del self._window_ids[: self._read_offset]  # prefix_offset = read_offset
        self._read_offset = len(self._window_ids)  # read_offset = end

    def _check_stop(self, num_chars_before: int) -> str | None:
        """Find the first stop string completed after `num_chars_before`; cut the text at it."""
        if (not self.stop or len(self.output_text) == num_chars_before
                or len(self.token_ids) <= self.min_tokens):
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = self.output_text.find(stop_str, max(num_chars_before - len(stop_str) + 1, 0))
            if start != -1:
                candidate = (start + len(stop_str), start, stop_str)
                best = candidate if best is None or candidate < best else best
        if best is None:
            return None
        end, start, stop_str = best
        self.output_text = self.output_text[: end if self.include_stop_str_in_output else start]
        self._stopped = True
        return stop_str

    def _byte_run_is_open(self) -> bool:
        """Whether the last token the decoder sees is a byte-fallback token (skipped ids aside)."""
        for token_id in reversed(self._window_ids[self._read_offset :]):
            if self.skip_special_tokens and token_id in self._get_special_ids():
                continue
            return self._is_byte_token(token_id)
        return False

    def _is_byte_token(self, token_id: int) -> bool:
        token = (self._id_to_token(token_id) if self._id_to_token is not None
                 else self.tokenizer.convert_ids_to_tokens(token_id))
        return isinstance(token, str) and _BYTE_FALLBACK_TOKEN.fullmatch(token) is not None

    def _get_special_ids(self) -> set[int]:
        if self._special_ids is None:
            # The ids `decode(skip_special_tokens=True)` drops: added tokens flagged special.
            self._special_ids = set(self.tokenizer.all_special_ids)
            self._special_ids.update(
                token_id
                for token_id, token in self.tokenizer.added_tokens_decoder.items()
                if getattr(token, "special", False)
            )
        return self._special_ids

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, self.skip_special_tokens)
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
