"""The llama.cpp speculative peer's loop (`benchmarks/llamacpp_spec.speculative_greedy`) on a
fake model with a checked KV cache: its tokens equal plain greedy decoding, rejected drafts'
KV entries are dropped, and llama-cpp-python's own drafter (when installed) plugs in."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pagedllm.benchmarks.llamacpp_spec import speculative_greedy
from tests.benchmarks.test_bench_smoke import _run, preset_dir  # noqa: F401


class FakeModel:
    """Next token = a fixed function of the previous two; the KV cache is the list of tokens
    whose entries exist, and `decode` asserts it continues it exactly (as llama.cpp requires
    positions to follow the cache)."""

    def __init__(self, vocab: int = 13) -> None:
        self.vocab = vocab
        self.kv: list[int] = []
        self.decodes = 0

    def next_token(self, a: int, b: int) -> int:
        return (3 * a + 5 * b + 1) % self.vocab if (a + b) % 4 else a

    def decode(self, tokens: list[int], first_pos: int) -> np.ndarray:
        assert first_pos == len(self.kv), "decode must continue the KV cache"
        self.kv.extend(tokens)
        self.decodes += 1
        return np.array([self.next_token(self.kv[first_pos + i - 1] if first_pos + i else 0, t)
                         for i, t in enumerate(tokens)])

    def truncate(self, pos: int) -> None:
        del self.kv[pos:]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ctx = list(prompt)
        for _ in range(n):
            ctx.append(self.next_token(ctx[-2] if len(ctx) > 1 else 0, ctx[-1]))
        return ctx[len(prompt):]


def _lookup(max_ngram: int, num_pred: int):
    """Prompt lookup as llama-cpp-python's `LlamaPromptLookupDecoding` (first match)."""
    def draft(ids: np.ndarray) -> np.ndarray:
        for n in range(min(max_ngram, len(ids) - 1), 0, -1):
            tail = ids[-n:]
            for i in range(len(ids) - n):
                if (ids[i:i + n] == tail).all() and i + n < len(ids):
                    return ids[i + n:i + n + num_pred]
        return np.zeros(0, dtype=np.intc)
    return draft


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_pred", [1, 4, 10])
def test_equals_plain_greedy(seed, num_pred):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 13, 20).tolist()
    model = FakeModel()
    out, steps, accepted = speculative_greedy(prompt, 40, model.decode, model.truncate,
                                              _lookup(2, num_pred))
    assert out == model.greedy(prompt, 40)
    assert steps == model.decodes - 1 and len(out) == 1 + steps + accepted
    assert model.kv == (prompt + out)[:len(model.kv)]      # no stale draft entries


def test_wrong_drafts_are_rejected_and_times_recorded():
    model = FakeModel()
    prompt = [1, 2, 3]
    times: list[float] = []
    out, steps, accepted = speculative_greedy(
        prompt, 10, model.decode, model.truncate,
        lambda ids: np.full(5, (int(ids[-1]) + 7) % 13, dtype=np.intc), times)
    assert out == model.greedy(prompt, 10)
    assert len(times) == 10 and times == sorted(times)
    with pytest.raises(ValueError):
        speculative_greedy([], 4, model.decode, model.truncate, _lookup(2, 2))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python not installed")
def test_llama_cpp_python_drafter_plugs_in():
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    model = FakeModel()
    prompt = [4, 5, 6, 4, 5, 6, 4, 5]
    out, _, _ = speculative_greedy(prompt, 30, model.decode, model.truncate,
                                   LlamaPromptLookupDecoding(2, 10))
    assert out == model.greedy(prompt, 30)


def test_llamacpp_spec_flag_needs_compare_and_batch_one(preset_dir):  # noqa: F811
    with pytest.raises(ValueError, match="--llamacpp-spec"):
        _run(["bench", "latency", "--preset", "llama-tiny", "--preset-dir", str(preset_dir),
              "--llamacpp-spec", "prompt-lookup"])
