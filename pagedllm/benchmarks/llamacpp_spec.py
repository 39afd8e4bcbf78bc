"""llama.cpp with speculative decoding, the peer of `bench latency --speculative-config`.

llama-cpp-python ships one drafter, prompt-lookup decoding (`llama_cpp.llama_speculative.
LlamaPromptLookupDecoding`, after Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding:
the continuation of the last n-gram's first earlier occurrence in the context, n from
`max_ngram_size` down to 1, up to `num_pred_tokens` drafts), and verifies its drafts in
`Llama.generate` with every row's logits copied into a numpy array per step. Here the same
drafter runs over llama.cpp's low-level API instead, so the peer pays no Python copies it need
not: per step one `llama_decode` of the last token and its drafts with logits for those rows,
the argmax of each row, greedy acceptance (drafts kept while each equals the argmax before it,
then that argmax: Leviathan et al. 2023), and the rejected drafts' KV entries removed
(`llama_memory_seq_rm`). Greedy only, batch 1 (one sequence), as `bench latency`'s waves of one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagedllm.benchmarks.report import percentiles
from pagedllm.benchmarks.workload import BenchRequest

SPEC_MODES = ("prompt-lookup",)


def speculative_greedy(prompt: Sequence[int], output_len: int,
                       decode: Callable[[list[int], int], np.ndarray],
                       truncate: Callable[[int], None],
                       drafter: Callable[[np.ndarray], np.ndarray],
                       token_times: list[float] | None = None) -> tuple[list[int], int, int]:
    """`output_len` greedy tokens after `prompt`, drafting with `drafter` and verifying drafts
    in one `decode` per step.

    Args:
        prompt: the prompt's token ids (at least one).
        output_len: tokens to generate (>= 1).
        decode: (tokens, first position) -> [len(tokens)] int argmax of the logits at each
            token; it stores their KV entries at positions first .. first + len - 1.
        truncate: (position) drops the KV entries from that position on.
        drafter: the context so far ([L] np.intc) -> proposed continuation (any length; cut to
            what is left to generate).
        token_times: gets `time.perf_counter()` once per emitted token.

    Returns:
        (tokens, steps (decode calls after the prompt's), drafts accepted).

    Raises:
        ValueError: an empty prompt or output_len < 1.
    """
    if not len(prompt) or output_len < 1:
        raise ValueError("speculative_greedy: needs a prompt and output_len >= 1")
    context = list(prompt)
    out = [int(decode(context, 0)[-1])]
    if token_times is not None:
        token_times.append(time.perf_counter())
    steps = accepted = 0
    while len(out) < output_len:
        last_pos = len(context) + len(out) - 1           # the last token's position
        full = np.asarray(context + out, dtype=np.intc)
        drafts = [int(t) for t in drafter(full)[:output_len - len(out) - 1]]
        targets = decode([out[-1]] + drafts, last_pos)
        steps += 1
        n = 0
        while n < len(drafts) and drafts[n] == int(targets[n]):
            n += 1
        if n < len(drafts):
            truncate(last_pos + 1 + n)                   # rejected drafts' KV entries
        accepted += n
        new = drafts[:n] + [int(targets[n])]
        out.extend(new)
        if token_times is not None:
            now = time.perf_counter()
            token_times.extend([now] * len(new))
    return out[:output_len], steps, accepted


class _LlamaCppSequence:
    """One llama.cpp sequence through the low-level API: decode with logits at every row."""

    def __init__(self, gguf_path: str, max_len: int, num_threads: int) -> None:
        from pagedllm.benchmarks.llamacpp_baseline import (load_llamacpp_model,
                                                           new_llamacpp_context)

        lc, self.model = load_llamacpp_model(gguf_path)
        self.lc = lc
        self.ctx = new_llamacpp_context(lc, self.model, n_ctx=max_len, n_batch=max_len,
                                        n_ubatch=max_len, n_seq_max=1, num_threads=num_threads)
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max_len, 0, 1)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def reset(self) -> None:
        self.lc.llama_memory_seq_rm(self.memory, 0, -1, -1)

    def truncate(self, pos: int) -> None:
        self.lc.llama_memory_seq_rm(self.memory, 0, pos, -1)

    def decode(self, tokens: list[int], first_pos: int, all_logits: bool = True) -> np.ndarray:
        """The argmax at each of `tokens` (positions first_pos ..); with `all_logits` False
        (a prompt), only the last row's logits are computed and returned."""
        lc, b = self.lc, self.batch
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, first_pos + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == len(tokens) - 1
        b.n_tokens = len(tokens)
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = len(tokens) if all_logits else 1
        logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))
        return logits.argmax(axis=1)


def run_llamacpp_spec_latency(gguf_path: str, requests: list[BenchRequest], mode: str,
                              num_pred_tokens: int = 10, max_ngram_size: int = 2,
                              num_iters_warmup: int = 1,
                              num_threads: int | None = None) -> dict[str, Any]:
    """`bench latency`'s waves of one request through llama.cpp with speculative decoding
    (`mode`: "prompt-lookup", llama-cpp-python's `LlamaPromptLookupDecoding(max_ngram_size,
    num_pred_tokens)`; its defaults 2 and 10), greedy; the first `num_iters_warmup` untimed.
    Figures as `run_llamacpp_latency`'s, plus the drafts accepted per step.

    Raises:
        ValueError: an unknown mode.
        RuntimeError: llama_cpp missing, a failed load or decode call.
    """
    if mode not in SPEC_MODES:
        raise ValueError(f"llama.cpp speculative mode {mode!r}: known {SPEC_MODES}")
    from pagedllm.benchmarks.llamacpp_baseline import llamacpp_unavailable_reason

    reason = llamacpp_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    drafter = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size,
                                        num_pred_tokens=num_pred_tokens)
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests) + num_pred_tokens + 8
    seq = _LlamaCppSequence(gguf_path, max_len, num_threads or os.cpu_count() or 1)
    ttft, tpot, itl, e2e = [], [], [], []
    steps = accepted = tokens = 0
    try:
        for i, r in enumerate(requests):
            seq.reset()
            times: list[float] = []
            start = time.perf_counter()
            out, n_steps, n_acc = speculative_greedy(
                r.prompt_token_ids, r.output_len,
                lambda t, p: seq.decode(t, p, all_logits=p > 0), seq.truncate, drafter, times)
            if i < num_iters_warmup:
                continue
            steps, accepted, tokens = steps + n_steps, accepted + n_acc, tokens + len(out)
            ttft.append(times[0] - start)
            e2e.append(times[-1] - start)
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(b - a for a, b in zip(times, times[1:]))
    finally:
        seq.close()
    return {"backend": "llama.cpp", "gguf": gguf_path, "batch_size": 1,
            "speculative": {"mode": mode, "num_pred_tokens": num_pred_tokens,
                            "max_ngram_size": max_ngram_size, "steps": steps,
                            "accepted_drafts": accepted,
                            "mean_tokens_per_step": (tokens - len(ttft)) / max(steps, 1)},
            "num_timed_requests": len(ttft), **percentiles(ttft, "ttft_ms", 1e3),
            **percentiles(tpot, "tpot_ms", 1e3), **percentiles(itl, "itl_ms", 1e3),
            **percentiles(e2e, "e2e_latency_ms", 1e3)}
