"""Suffix decoding proposer (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding
for Emerging AI Applications"; Arctic Inference's `SuffixDecodingCache` is the reference design,
vLLM's `method: "suffix"` the interface).

Two suffix trees answer each request's query:
- a per-request tree over its prompt and the output so far;
- a global tree over the outputs of earlier (and currently running) requests, holding at most
  `max_cached_requests` finished requests (FIFO: the oldest finished request leaves whole).

Query: for each match length m = 1 .. max_tree_depth, the node reached by the context's last m
tokens is walked greedily, always taking the most frequent child; the path probability is the
product of count(child) / count(node) and the walk stops once it falls below `min_token_prob`
or after min(k, floor(m * max_spec_factor)) tokens. The draft's score is the sum of its path
probabilities; the best-scoring draft over both trees and every m wins (longer m on ties).

NOTE(suffix): the trees are implicit. A node of a suffix tree over token sequences is the set of
positions where its path ends, and count(node) is that set's size, so a sorted positions array
answers the same queries (matching narrows the set by one earlier token per level, walking
narrows it to the positions followed by the chosen token). This keeps no per-token node objects
(a depth-24 trie in Python costs kilobytes per token) and nothing to update per token but the
outputs of the global corpus. Unlike Arctic's depth-bounded tree, the walk's length is not
capped by max_tree_depth minus m (only matching is): a long match is the best case.

Drafts are deterministic (a one-hot proposal), so the rejection sampler keeps outputs exact.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Separates sequences in a concatenated corpus: no context token equals it, so matches never
# cross a boundary, and it is never proposed.
_SEP = -1


@dataclass
class SuffixDraft:
    """A proposal: tokens, score (sum of path probabilities), the match length it came from."""

    token_ids: list[int]
    score: float = 0.0
    match_len: int = 0


def _walk(corpus: np.ndarray, ends: np.ndarray, max_tokens: int, min_token_prob: float
          ) -> SuffixDraft:
    """Greedy path from the node whose path ends at `ends` (positions in `corpus`).

    Args:
        corpus: [L] int64 tokens, sequences separated by _SEP.
        ends: [c] int64 positions where the matched path ends (count(node) = c > 0).
        max_tokens: most tokens to propose.
        min_token_prob: stop once the path probability falls below it.
    """
    tokens: list[int] = []
    score, prob = 0.0, 1.0
    n = len(corpus)
    while len(tokens) < max_tokens:
        nxt = ends + 1
        nxt = nxt[nxt < n]
        follow = corpus[nxt]
        keep = follow != _SEP
        nxt, follow = nxt[keep], follow[keep]
        if not len(follow):
            break
        if len(follow) == 1 or (follow == follow[0]).all():
            token, count = int(follow[0]), len(follow)
        else:
            values, counts = np.unique(follow, return_counts=True)
            best = int(np.argmax(counts))
            token, count = int(values[best]), int(counts[best])
        prob *= count / len(ends)
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        ends = nxt[follow == token] if count < len(follow) else nxt
    return SuffixDraft(tokens, score)


def speculate(corpus: np.ndarray, context: np.ndarray, max_spec_tokens: int,
              max_tree_depth: int, max_spec_factor: float, min_token_prob: float,
              min_match_len: int = 1) -> SuffixDraft:
    """The best draft for `context` [C] int64 from the suffix tree over `corpus` [L] int64
    (sequences separated by -1): every match length up to `max_tree_depth` is tried and the
    highest score wins, the longer match on ties (Arctic's `SuffixTree::speculate`). Matches
    shorter than `min_match_len` propose nothing (a pagedllm option, 1 = Arctic's and vLLM's
    behaviour)."""
    best = SuffixDraft([])
    if not len(context) or not len(corpus) or max_spec_tokens <= 0:
        return best
    ends = np.flatnonzero(corpus == context[-1])
    max_m = min(max_tree_depth, len(context))
    m = 1
    while len(ends):
        # Extend the match by one earlier token (positions where the path of length m + 1 ends).
        if m < max_m:
            ok = ends >= m
            cand = ends[ok]
            longer = cand[corpus[cand - m] == context[-1 - m]]
        else:
            longer = ends[:0]
        # A match that does not narrow the set walks the same path with a higher cap: only
        # the longest of a run of equal sets needs walking.
        if m >= min_match_len and (len(longer) != len(ends) or m == max_m):
            limit = min(max_spec_tokens, int(m * max_spec_factor + 1e-6))
            draft = _walk(corpus, ends, limit, min_token_prob)
            if draft.token_ids and draft.score >= best.score:
                draft.match_len = m
                best = draft
        if m == max_m:
            break
        ends = longer
        m += 1
    return best


class SuffixDecodingProposer:
    """Per-request and global suffix trees over token ids; proposes without a model.

    Args:
        num_speculative_tokens: most drafts per step (k).
        max_tree_depth: longest context suffix matched (vLLM's suffix_decoding_max_tree_depth).
        max_cached_requests: finished requests kept in the global tree; 0 disables it.
        max_spec_factor: drafts per matched token (a match of m tokens proposes at most
            m * factor).
        min_token_prob: lowest path probability of a proposed token.
        min_match_len: shortest context match that proposes (pagedllm's cost-aware option,
            not in vLLM; 1, the default, proposes from any match as vLLM does). On a CPU where
            verifying a draft token costs a fixed share of a plain step, the drafts of one-
            or two-token matches are rejected so often that they cost more than they save.
    """

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, min_match_len: int = 1) -> None:
        self.k = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.min_match_len = min_match_len
        # req_id -> output token ids so far (running or preempted requests).
        self._active: dict[str, np.ndarray] = {}
        # Finished requests' outputs, oldest first; concatenated lazily into _finished_corpus.
        self._finished: OrderedDict[str, np.ndarray] = OrderedDict()
        self._finished_corpus: np.ndarray | None = np.zeros(0, dtype=np.int64)

    @property
    def num_cached_requests(self) -> int:
        return len(self._finished)

    def stop_requests(self, req_ids) -> None:
        """Requests that finished (or were aborted): their outputs join the global tree's
        finished part, evicting the oldest beyond `max_cached_requests`."""
        for req_id in req_ids:
            output = self._active.pop(req_id, None)
            if output is None or self.max_cached_requests <= 0 or not len(output):
                continue
            self._finished[req_id] = output
            while len(self._finished) > self.max_cached_requests:
                self._finished.popitem(last=False)
            self._finished_corpus = None

    def remove_requests(self, req_ids) -> None:
        """Forget requests without caching their outputs (e.g. the runner's dummy requests)."""
        for req_id in req_ids:
            self._active.pop(req_id, None)

    def propose(self, req_ids: list[str], token_ids: list[np.ndarray],
                num_prompt_tokens: np.ndarray, max_drafts: np.ndarray) -> list[list[int]]:
        """Drafts for B requests.

        Args:
            req_ids: [B] request ids.
            token_ids: B int arrays, each request's prompt and output tokens so far.
            num_prompt_tokens: [B] prompt length of each.
            max_drafts: [B] most drafts allowed per request (k or fewer; 0 = none).

        Returns:
            B lists of draft token ids (possibly empty).
        """
        for req_id, tokens, n in zip(req_ids, token_ids, num_prompt_tokens.tolist()):
            self._active[req_id] = np.asarray(tokens[n:], dtype=np.int64).copy()
        corpus = self._global_corpus()
        drafts = []
        for tokens, limit in zip(token_ids, max_drafts.tolist()):
            limit = min(self.k, int(limit))
            if limit <= 0:
                drafts.append([])
                continue
            tokens = np.asarray(tokens, dtype=np.int64)
            context = tokens[-self.max_tree_depth:]
            args = (limit, self.max_tree_depth, self.max_spec_factor, self.min_token_prob,
                    self.min_match_len)
            local = speculate(tokens, context, *args)
            shared = speculate(corpus, context, *args)
            drafts.append((shared if shared.score > local.score else local).token_ids)
        return drafts

    def _global_corpus(self) -> np.ndarray:
        """Finished and running outputs, each followed by the separator."""
        if self._finished_corpus is None:
            self._finished_corpus = _concat(self._finished.values())
        if self.max_cached_requests <= 0:
            return self._finished_corpus
        return np.concatenate([self._finished_corpus, _concat(self._active.values())])


def _concat(seqs) -> np.ndarray:
    parts = []
    for s in seqs:
        parts.append(s)
        parts.append(np.array([_SEP], dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
