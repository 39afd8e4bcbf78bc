"""The `<think>...</think>` reasoning formats (vLLM's `deepseek_r1` and `qwen3` parsers).

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3 "thinking" checkpoints whose chat
  template already opens `<think>` in the prompt): the output is reasoning up to `</think>`, the
  answer after it. A leading `<think>` is dropped. An output that never closes the block is all
  reasoning (the model was cut off while thinking).
- `qwen3` (Qwen3 hybrid models, which write `<think>` themselves when thinking is on): the output
  is reasoning only when it starts with `<think>`; otherwise it is all answer (thinking off).

Both rules read the output alone, never the prompt, so the server's split and the engine's
grammar switch (which watches the same markers as token ids) always agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSplit:
    """One output split in two. `reasoning` is None when the output has no reasoning part."""

    reasoning: str | None
    content: str


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none):
    the characters a stream holds back because they may be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """A reasoning format.

    Attributes:
        name: the `--reasoning-parser` value.
        start: the marker that opens the reasoning (`<think>`).
        end: the marker that closes it (`</think>`).
        implicit_start: True when the output is reasoning from its first character whether or not
            it starts with `start` (deepseek_r1); False when only an output that starts with
            `start` reasons (qwen3).
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = True

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        """Split a whole output (`final`) or the output so far of a stream (not `final`: a
        suffix that may be the start of a marker is held back from both parts, so the parts only
        ever grow as the text grows).
        """
        body = text
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and body and self.start.startswith(body):
            return ReasoningSplit(None, "")       # may still become `start`: decide later
        elif not self.implicit_start:
            return ReasoningSplit(None, text)
        end = body.find(self.end)
        if end >= 0:
            return ReasoningSplit(body[:end], body[end + len(self.end):])
        if not final:
            body = body[:len(body) - partial_marker_len(body, self.end)]
        return ReasoningSplit(body, "")

    def num_reasoning_tokens(self, token_ids: list[int], marker_ids: tuple[int, int]) -> int:
        """Output tokens that belong to the reasoning, its markers included, by the same rule as
        `split` read on token ids (`marker_ids`: from `marker_token_ids`)."""
        start, end = marker_ids
        if not token_ids or (not self.implicit_start and token_ids[0] != start):
            return 0
        return token_ids.index(end) + 1 if end in token_ids else len(token_ids)

    def marker_token_ids(self, tokenizer) -> tuple[int, int]:
        """(start id, end id) of the markers in the model's vocabulary.

        Raises:
            ValueError: a marker is not one token of this tokenizer (the parser does not fit the
                model).
        """
        ids = []
        for marker in (self.start, self.end):
            token_id = tokenizer.convert_tokens_to_ids(marker)
            if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id",
                                                                   None):
                raise ValueError(f"reasoning parser {self.name!r} needs {marker!r} as one token "
                                 "of the model's vocabulary; this tokenizer has no such token")
            ids.append(token_id)
        return ids[0], ids[1]


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
    "qwen3": ReasoningParser("qwen3", implicit_start=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{sorted(REASONING_PARSERS)}") from None
