"""Token strings and raw bytes for logprobs, decoded in context.

A logprob's token string is the text that token adds to the text before it, computed by the same
incremental decode as the output text (`IncrementalDetokenizer`), so joining the chosen tokens'
strings gives the decoded text (SentencePiece leading spaces kept, no spurious first-token strip).
A token that completes no character yet (the first bytes of a character split over byte tokens, an
open byte-fallback run) gets the empty string; the token that completes the character gets all of
it. vLLM instead decodes each id alone (`decode([id])`), which loses both properties.

Top alternatives get the text they would add in the same context (context + that token), with the
same rule (incomplete -> ""), so a chosen token's string is the same in both places.

`TokenBytes` gives a token's own raw bytes: for byte-level BPE its piece mapped through the GPT-2
byte decoder table, for a byte-fallback token `<0xNN>` the byte, for other pieces the UTF-8 of the
piece with '▁' as space; for special and added tokens the UTF-8 of their text in context.
"""

from __future__ import annotations

import json
import re

from pagedllm.engine.detokenizer import IncrementalDetokenizer

_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT_CHAR = "\ufffd"


class ContextDecoder:
    """Per-token text of a sequence of tokens after a context of token ids.

    `add(token_id)` returns the text the token adds ("" while it completes no character);
    `alternative(token_id)` the text a different token would add at the same position (nothing is
    appended); `flush()` the text of tokens still held, decoded as is (U+FFFD included).
    """

    def __init__(self, tokenizer, context_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(
            tokenizer, context_ids, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens)
        self._prefix_text: str | None = None  # decode of the window before read_offset

    def add(self, token_id: int) -> str:
        before = len(self._detok.output_text)
        self._detok.update([token_id])
        self._prefix_text = None
        return self._detok.output_text[before:]

    def alternative(self, token_id: int) -> str:
        detok = self._detok
        window = detok._window_ids
        if self._prefix_text is None:
            self._prefix_text = detok._decode(window[: detok._read_offset])
        full = detok._decode(window + [token_id])
        prefix = self._prefix_text
        text = full[len(prefix):] if full.startswith(prefix) else ""
        if (not text or text.endswith(_REPLACEMENT_CHAR)
                or (detok._is_byte_token(token_id) and not (
                    detok.skip_special_tokens and token_id in detok._get_special_ids()))):
            return ""
        return text

    def flush(self) -> str:
        before = len(self._detok.output_text)
        self._detok.get_next_output_text(finished=True, delta=False)
        self._prefix_text = None
        return self._detok.output_text[before:]


def token_strings(tokenizer, token_ids: list[int], *,
                  skip_special_tokens: bool = True) -> list[str]:
    """Per-token text of `token_ids` decoded from the start: "".join(result) equals
    `decode(token_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` (the text of
    tokens still held at the end goes to the last token)."""
    decoder = ContextDecoder(tokenizer, [], skip_special_tokens=skip_special_tokens)
    result = [decoder.add(t) for t in token_ids]
    rest = decoder.flush()
    if rest and result:
        result[-1] += rest
    return result


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's `bytes_to_unicode`: printable stand-in character -> byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _gpt2_byte_decoder()


def _decoder_types(tokenizer) -> set[str]:
    """Types of the backend (tokenizers) decoder and its Sequence members; empty if unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - an unknown decoder: fall back to plain pieces
        return {type(decoder).__name__}
    types, stack = set(), [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            types.add(node.get("type"))
            stack.extend(node.get("decoders") or [])
    return types


class TokenBytes:
    """A token's own raw bytes (see the module docstring), cached per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in types
        self.metaspace = bool(types & {"Metaspace", "Replace", "ByteFallback"})
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._special.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, bytes] = {}

    def get(self, token_id: int, text: str) -> bytes:
        """Raw bytes of `token_id`; `text` (its string in context) for special and added tokens."""
        if token_id in self._special:
            return text.encode()
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._raw(token_id, text)
            self._cache[token_id] = raw
        return raw

    def _raw(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return text.encode()
        if self.byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        match = _BYTE_FALLBACK_TOKEN.fullmatch(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        if self.metaspace:
            return piece.replace("▁", " ").encode()
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()
