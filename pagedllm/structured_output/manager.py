"""StructuredOutputManager (engine side): compiles grammars with xgrammar, keeps one matcher per
structured request, builds each step's token bitmask and advances matchers with accepted tokens.

- Parsing (`build_grammar`) runs at admission (the InputProcessor), so an invalid schema or
  grammar is a ValueError for that request alone, before it is queued. A compile that still fails
  later fails that request alone (the scheduler finishes it with "error"). Compiling runs on a background thread, cached per distinct
  spec; the scheduler does not schedule a structured request until its grammar is ready, so a slow
  compile never stalls other requests.
- The bitmask is int32 [rows, ceil(vocab / 32)] (bit t of a row = token t allowed), one row per
  logits row of each structured request that samples this step: 1 row, or k+1 with k drafts
  (the draft prefix is accepted into the matcher, the row filled, then rolled back).
- Draft tokens are checked against the grammar before they are scheduled (`validate_tokens`).
- With a reasoning parser (`pagedllm/reasoning`), a request's grammar starts after its reasoning:
  tokens up to the `</think>` token are free (bitmask rows all ones; the matcher does not move),
  the grammar constrains the next token on. For a `qwen3`-style parser the first token may also
  be `<think>` (thinking on) or the grammar's (thinking off). Drafts never cross the switch.

This module imports xgrammar (and through it torch) but is only handed to the scheduler as an
object; `pagedllm/core` itself stays free of torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pagedllm.structured_output.json_schema_fix import (UnsupportedJSONSchemaError,
                                                       json_schema_grammar)
from pagedllm.structured_output.params import StructuredOutputsParams


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _choice_to_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of a spec (parsing only, no tokenizer needed).

    A JSON schema goes through `json_schema_fix.json_schema_grammar`, which refuses features
    xgrammar would not enforce and corrects its length-bounded strings.

    Raises:
        ValueError: the schema, regex or grammar does not parse (message without xgrammar's
            source-location prefix), or the JSON schema uses an unsupported feature.
    """
    import xgrammar as xgr

    kind, spec = params.key()
    try:
        if kind == "json":
            return json_schema_grammar(spec)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_regex(_choice_to_regex(json.loads(spec)))
        return xgr.Grammar.from_ebnf(spec)
    except UnsupportedJSONSchemaError as e:
        raise ValueError(f"structured_outputs: unsupported JSON schema feature {e}") from e
    except (RuntimeError, ValueError, TypeError) as e:
        # Drop xgrammar's "[time] /path/file.cc:line: " prefix from its messages.
        message = _XGRAMMAR_PREFIX.sub("", str(e).splitlines()[0] if str(e) else type(e).__name__)
        what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
        raise ValueError(f"structured_outputs: invalid {what}: {message}") from e


_REASONING, _FIRST = "reasoning", "first"    # per-request states before the grammar applies


def _set_bit(bitmask, row: int, token_id: int) -> None:
    """Allow `token_id` in an int32 bitmask row (bit 31 of a word is its sign bit)."""
    word, bit = divmod(token_id, 32)
    value = 1 << bit
    bitmask[row, word] = int(bitmask[row, word]) | (value - (1 << 32) if bit == 31 else value)


def _tokenizer_info(xgr, tokenizer, vocab_size: int):
    """xgrammar's TokenizerInfo of an HF tokenizer, with its special tokens (all_special_ids and
    added tokens flagged special, less the stop tokens) made special for xgrammar: never allowed.

    NOTE(json_schema_fix): xgrammar 0.2.9 reads a byte-level vocabulary's "<s>" or "<pad>" as
    that literal text, so a grammar accepted them inside strings while the detokenizer drops them
    (skip_special_tokens), e.g. '["", "lus"]' for a pattern needing 1-3 characters. An empty
    token is what xgrammar treats as special.
    """
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in tokenizer.added_tokens_decoder.items()
        if getattr(token, "special", False)}
    special -= set(info.stop_token_ids) | set(info.special_token_ids)
    vocab = list(info.decoded_vocab)
    special = {t for t in special if 0 <= t < len(vocab)}
    if not special:
        return info
    for token_id in special:
        vocab[token_id] = b""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                             stop_token_ids=info.stop_token_ids,
                             add_prefix_space=info.add_prefix_space)


class StructuredOutputManager:
    """Args: a zero-argument function returning the model's HF tokenizer, the vocabulary size
    (the logits width), and the engine's reasoning parser name (or None). xgrammar is imported
    and the tokenizer read on first use only, so engines that never see a structured request pay
    nothing (a reasoning parser reads the tokenizer at once, to fail at start-up when its markers
    are not tokens of this model).

    Raises:
        ValueError: an unknown reasoning parser, or one whose markers this tokenizer lacks.
    """

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 reasoning_parser: str | None = None) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._reasoning = None
        self._reasoning_state: dict[str, str] = {}
        if reasoning_parser is not None:
            from pagedllm.reasoning import get_reasoning_parser
            parser = get_reasoning_parser(reasoning_parser)
            start, end = parser.marker_token_ids(load_tokenizer())
            self._reasoning = (parser.implicit_start, start, end)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiled: dict[tuple[str, str], Future] = {}
        self._matchers: dict[str, object] = {}
        self._pending: dict[str, Future] = {}
        self._compiler = None

    @property
    def _xgr(self):
        import xgrammar
        return xgrammar

    @property
    def compiler(self):
        if self._compiler is None:
            info = _tokenizer_info(self._xgr, self._load_tokenizer(), self.vocab_size)
            self._compiler = self._xgr.GrammarCompiler(info)
        return self._compiler

    # ----------------------------------------------------------------- grammars
    def add_request(self, req_id: str, params: StructuredOutputsParams) -> None:
        """Start (or reuse) the compile of the request's grammar in the background."""
        key = params.key()
        future = self._compiled.get(key)
        if future is None:
            future = self._executor.submit(lambda: self.compiler.compile_grammar(
                build_grammar(params)))
            self._compiled[key] = future
        self._pending[req_id] = future
        if self._reasoning is not None:
            self._reasoning_state[req_id] = _REASONING if self._reasoning[0] else _FIRST

    def is_ready(self, req_id: str) -> bool:
        """Whether the request's grammar is compiled (its matcher then exists)."""
        if req_id in self._matchers:
            return True
        future = self._pending.get(req_id)
        if future is None or not future.done():
            return False
        self._matchers[req_id] = self._xgr.GrammarMatcher(future.result())
        del self._pending[req_id]
        return True

    def remove_request(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._reasoning_state.pop(req_id, None)

    # ----------------------------------------------------------------- per step
    def validate_tokens(self, req_id: str, token_ids: list[int]) -> list[int]:
        """The longest prefix of draft `token_ids` the grammar accepts (matcher unchanged).
        While the request reasons: the drafts up to its end marker (none for the first token of a
        request that may or may not reason)."""
        state = self._reasoning_state.get(req_id)
        if state == _FIRST:
            return []
        if state == _REASONING:
            end = self._reasoning[2]
            return token_ids[:token_ids.index(end) + 1] if end in token_ids else token_ids
        matcher = self._matchers[req_id]
        accepted = 0
        for t in token_ids:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return token_ids[:accepted]

    def grammar_bitmask(self, requests: list[tuple[str, list[int]]]) -> np.ndarray:
        """Bitmask rows for (req_id, scheduled draft tokens) pairs, in order: 1 + len(drafts)
        rows each. Returns int32 [rows, ceil(vocab / 32)]."""
        num_rows = sum(1 + len(d) for _, d in requests)
        bitmask = self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        row = 0
        for req_id, drafts in requests:
            matcher = self._matchers[req_id]
            state = self._reasoning_state.get(req_id)
            if state is not None:
                row = self._fill_reasoning_rows(bitmask, row, matcher, state, drafts)
                continue
            accepted = 0
            for i in range(len(drafts) + 1):
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(bitmask, row)
                else:
                    bitmask[row] = -1   # terminated: anything (the request stops anyway)
                row += 1
                if i < len(drafts) and matcher.accept_token(drafts[i]):
                    accepted += 1
            if accepted:
                matcher.rollback(accepted)
        return bitmask.numpy()

    def _fill_reasoning_rows(self, bitmask, row: int, matcher, state: str,
                             drafts: list[int]) -> int:
        """Rows of a request whose grammar has not started (see `validate_tokens` for the
        drafts it may have). Returns the next row."""
        _, start, end = self._reasoning
        for i in range(len(drafts) + 1):
            if state == _FIRST and i == 0:
                matcher.fill_next_token_bitmask(bitmask, row)     # the grammar's, or <think>
                _set_bit(bitmask, row, start)
            elif end in drafts[:i]:
                matcher.fill_next_token_bitmask(bitmask, row)     # the first answer token
            else:
                bitmask[row] = -1
            row += 1
        return row

    def _leave_reasoning(self, req_id: str, token_ids: list[int]) -> list[int] | None:
        """Advance a request's reasoning state over accepted tokens. Returns the tokens that
        belong to the grammar (after the switch), or None while the request still reasons."""
        state = self._reasoning_state[req_id]
        _, start, end = self._reasoning
        for i, t in enumerate(token_ids):
            if state == _FIRST:
                if t != start:                  # thinking off: this token is the answer's
                    del self._reasoning_state[req_id]
                    return token_ids[i:]
                state = _REASONING
            elif t == end:
                del self._reasoning_state[req_id]
                return token_ids[i + 1:]
        self._reasoning_state[req_id] = state
        return None

    def accept_tokens(self, req_id: str, token_ids: list[int]) -> bool:
        """Advance the matcher; returns True when the grammar has terminated (request done)."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return False
        if req_id in self._reasoning_state:
            token_ids = self._leave_reasoning(req_id, token_ids)
            if token_ids is None:
                return False
        for t in token_ids:
            if matcher.is_terminated():
                break
            matcher.accept_token(t)
        return matcher.is_terminated()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
