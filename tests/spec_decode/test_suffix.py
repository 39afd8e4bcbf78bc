"""Suffix decoding: the implicit suffix tree against an explicit one, the global cache's FIFO
bound, and the engine with `method: "suffix"` (greedy unchanged under preemption, prefix caching
and n > 1; earlier outputs drafted from the global tree; seeded sampling distributed as without
speculation)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.suffix import SuffixDecodingProposer, speculate


class _Trie:
    """An explicit suffix trie (every suffix of every sequence inserted, counts per node): the
    structure of Arctic's SuffixTree without its depth bound."""

    def __init__(self, seqs):
        self.root = [0, {}]
        for seq in seqs:
            for i in range(len(seq)):
                node = self.root
                for t in seq[i:]:
                    node = node[1].setdefault(t, [0, {}])
                    node[0] += 1

    def speculate(self, context, max_tokens, max_depth, factor, min_prob, min_match_len=1):
        best = ([], 0.0)
        for m in range(1, min(max_depth, len(context)) + 1):
            node = self.root
            for t in context[len(context) - m:]:
                node = node[1].get(t)
                if node is None:
                    return best
            if m < min_match_len:
                continue
            limit = min(max_tokens, int(m * factor + 1e-6))
            tokens, score, prob = [], 0.0, 1.0
            while len(tokens) < limit and node[1]:
                token = min(node[1], key=lambda t: (-node[1][t][0], t))
                prob *= node[1][token][0] / node[0]
                if prob < min_prob:
                    break
                tokens.append(token)
                score += prob
                node = node[1][token]
            if tokens and score >= best[1]:
                best = (tokens, score)
        return best


@pytest.mark.parametrize("seed", range(6))
def test_speculate_matches_explicit_trie(seed):
    rng = np.random.default_rng(seed)
    vocab = 3 + seed % 3
    seqs = [rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist() for _ in range(3)]
    corpus = np.array([t for s in seqs for t in s + [-1]], dtype=np.int64)
    trie = _Trie(seqs)
    for _ in range(20):
        context = rng.integers(0, vocab, size=int(rng.integers(1, 12))).astype(np.int64)
        for depth, factor, min_prob, min_match in ((24, 1.0, 0.1, 1), (3, 2.0, 0.0, 1),
                                                   (8, 0.5, 0.3, 1), (24, 1.0, 0.1, 3),
                                                   (8, 2.0, 0.0, 2)):
            got = speculate(corpus, context, 6, depth, factor, min_prob, min_match)
            want = trie.speculate(context.tolist(), 6, depth, factor, min_prob, min_match)
            assert got.token_ids == want[0]
            assert got.score == pytest.approx(want[1])


def test_local_tree_and_global_fifo():
    p = SuffixDecodingProposer(4, max_cached_requests=2)
    prompt = np.array([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    # The request's own prompt: "1 2 3" was followed by "4 5 6" (a 3-token match allows 3).
    assert p.propose(["a"], [prompt], np.array([10]), np.array([4])) == [[4, 5, 6]]
    assert p.propose(["a"], [prompt], np.array([10]), np.array([2])) == [[4, 5]]
    assert p.propose(["a"], [prompt], np.array([10]), np.array([0])) == [[]]
    # Outputs of finished requests are drafted for later ones, oldest evicted first.
    for i, req in enumerate("bcd"):
        tokens = np.array([50, 60 + i, 70 + i, 80 + i, 90 + i])
        p.propose([req], [tokens], np.array([1]), np.array([4]))
        p.stop_requests([req])
    assert p.num_cached_requests == 2
    drafts = p.propose(["e", "f"], [np.array([9, 62]), np.array([9, 60])], np.array([1, 1]),
                       np.array([4, 4]))
    assert drafts == [[72], []]    # "b" (60 ..) was evicted; a 1-token match proposes 1
    p.remove_requests(["e", "f"])
    p.stop_requests(["e"])
    assert p.num_cached_requests == 2


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 61)), [100, 3, 250, 7] * 5,
           [9, 10, 11] * 10, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(target):
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20)
    return _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_greedy_unchanged_preemption_prefix_caching_n(target, reference):
    llm = LLM(target, dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=32,
              speculative_config=SUFFIX)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.get_stats().num_preemptions > 0
    # Again, now with prefix-cache hits and the first round's outputs in the global tree.
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    n2 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    assert _tokens(llm.generate(PROMPTS[:2], n2, use_tqdm=False)) == [r * 2
                                                                    for r in reference[:2]]
    assert llm.get_stats().spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("max_cached_requests", [0, 16])
def test_global_tree_drafts_earlier_outputs(target, reference, max_cached_requests):
    """The same prompt again: with the global tree the first answer is drafted and accepted
    (random weights give non-repetitive text the local tree cannot predict)."""
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=dict(
        SUFFIX, suffix_decoding_max_cached_requests=max_cached_requests))
    assert _tokens(llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)) == [reference[1]]
    before = llm.get_stats().spec_decoding_stats
    assert _tokens(llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)) == [reference[1]]
    after = llm.get_stats().spec_decoding_stats
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if max_cached_requests:
        assert accepted >= 18   # of the 23 tokens after the first
    else:
        assert accepted == before.num_accepted_tokens


def test_min_match_len_greedy_unchanged(target, reference):
    """The cost-aware option (no drafts from matches shorter than 3 tokens): the same greedy
    tokens; the second round drafts the first round's outputs (long matches in the global
    tree; random weights give text whose short matches the option drops)."""
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
              speculative_config=dict(SUFFIX, suffix_decoding_min_match_len=3))
    for _ in range(2):
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.get_stats().spec_decoding_stats.num_accepted_tokens > 0
    with pytest.raises(ValueError, match="suffix_decoding_min_match_len"):
        LLM(target, dtype="float32", kv_cache_memory_bytes=8 << 20,
            speculative_config=dict(SUFFIX, suffix_decoding_min_match_len=0))


def test_seeded_sampling_distributed_as_without(target):
    """Output token 1 is always verified against a draft (sampling is restricted to tokens
    1..8 and the prompt holds each twice, so the first sampled token always matches); over many
    seeds its distribution must be the one sampled without speculation (two-sample chi-square)
    and the draft (the prompt's next token) must not be favoured."""
    allowed = list(range(1, 9))
    prompt = allowed * 2
    n = 600
    params = [SamplingParams(temperature=3.0, seed=s, max_tokens=2, ignore_eos=True,
                             allowed_token_ids=allowed) for s in range(n)]
    runs = {}
    for name, spec in (("plain", None), ("suffix", dict(SUFFIX, num_speculative_tokens=1))):
        llm = LLM(target, dtype="float32", kv_cache_memory_bytes=16 << 20,
                  speculative_config=spec)
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        runs[name] = np.array([o.outputs[0].token_ids for o in outs])
        if spec:
            assert llm.get_stats().spec_decoding_stats.num_drafts == n
    counts = np.array([np.bincount(r[:, 1], minlength=9)[1:] for r in runs.values()])
    counts = counts[:, counts.sum(0) > 0]
    assert stats.chi2_contingency(counts).pvalue > 1e-3, counts
    hit = [np.mean(r[:, 1] == r[:, 0] % 8 + 1) for r in runs.values()]
    assert abs(hit[0] - hit[1]) < 0.08, hit
