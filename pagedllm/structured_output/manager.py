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

This module imports xgrammar (and through it torch) but is only handed to the scheduler as an
object; `pagedllm/core` itself stays free of torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pagedllm.structured_output.params import StructuredOutputsParams


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _choice_to_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of a spec (parsing only, no tokenizer needed).

    Raises:
        ValueError: the schema, regex or grammar does not parse (message without xgrammar's
            source-location prefix).
    """
    import xgrammar as xgr

    kind, spec = params.key()
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_regex(_choice_to_regex(json.loads(spec)))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        # Drop xgrammar's "[time] /path/file.cc:line: " prefix from its messages.
        message = _XGRAMMAR_PREFIX.sub("", str(e).splitlines()[0] if str(e) else type(e).__name__)
        what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
        raise ValueError(f"structured_outputs: invalid {what}: {message}") from e


class StructuredOutputManager:
    """Args: a zero-argument function returning the model's HF tokenizer, and the vocabulary size
    (the logits width). xgrammar is imported and the tokenizer read on first use only, so engines
    that never see a structured request pay nothing."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
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
            info = self._xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(),
                                                            vocab_size=self.vocab_size)
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

    # ----------------------------------------------------------------- per step
    def validate_tokens(self, req_id: str, token_ids: list[int]) -> list[int]:
        """The longest prefix of draft `token_ids` the grammar accepts (matcher unchanged)."""
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

    def accept_tokens(self, req_id: str, token_ids: list[int]) -> bool:
        """Advance the matcher; returns True when the grammar has terminated (request done)."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return False
        for t in token_ids:
            if matcher.is_terminated():
                break
            matcher.accept_token(t)
        return matcher.is_terminated()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
