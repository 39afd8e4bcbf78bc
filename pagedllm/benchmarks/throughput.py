"""Offline throughput: the whole workload through `LLM.generate` at once.

Reports requests/s, output tokens/s, total (prompt + output) tokens/s, elapsed time and peak RSS.
A short warm-up request runs first so one-time costs (allocator growth, lazy init) stay out of the
timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedllm.benchmarks.report import PeakRSSMonitor, load_average, process_peak_rss_bytes
from pagedllm.benchmarks.workload import BenchRequest, sampling_params_for


def warmup_prompt(requests: list[BenchRequest], length: int = 16) -> list[int]:
    """A short prompt that shares no prefix with the workload's prompts (no prefix-cache hit)."""
    ids = requests[0].prompt_token_ids
    return [ids[-1] if t == ids[0] else ids[0] for t in ids[:length]]


def throughput_figures(backend: str, requests: list[BenchRequest],
                       output_token_ids: list[list[int]], elapsed_s: float,
                       peak_rss_bytes: int) -> dict[str, Any]:
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    num_out = sum(len(t) for t in output_token_ids)
    return {
        "backend": backend,
        "num_requests": len(requests),
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "num_wrong_output_lens": sum(len(t) != r.output_len
                                     for r, t in zip(requests, output_token_ids)),
        "elapsed_s": elapsed_s,
        "requests_per_s": len(requests) / elapsed_s,
        "output_tokens_per_s": num_out / elapsed_s,
        "total_tokens_per_s": (num_in + num_out) / elapsed_s,
        "peak_rss_bytes": peak_rss_bytes,
        "peak_rss_gib": peak_rss_bytes / 2**30,
        "process_peak_rss_gib": process_peak_rss_bytes() / 2**30,
        "load_avg_1m_after": load_average(),
    }


def run_throughput(llm, requests: list[BenchRequest], warmup: bool = True,
                   before_timing: Callable[[], None] | None = None,
                   lora_requests: list | None = None
                   ) -> tuple[dict[str, Any], list[list[int]]]:
    """Run `requests` through `llm.generate` (under `lora_requests`, one per request, if
    given); returns (figures, output token ids per request). `before_timing` is called after
    the warm-up, just before the timed run (the co-tenant copies meet there)."""
    from pagedllm import SamplingParams

    if warmup:
        llm.generate([{"prompt_token_ids": warmup_prompt(requests)}],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    if before_timing is not None:
        before_timing()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [sampling_params_for(r) for r in requests]
    with PeakRSSMonitor() as mem:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return throughput_figures("pagedllm", requests, token_ids, elapsed, mem.peak_bytes), token_ids


def compare(ours: dict[str, Any], theirs: dict[str, Any],
            ours_tokens: list[list[int]] | None = None,
            theirs_tokens: list[list[int]] | None = None) -> dict[str, Any]:
    """Ratios ours / theirs of the rate figures (> 1: we are faster), and greedy agreement."""
    out: dict[str, Any] = {"baseline": theirs["backend"]}
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        if theirs.get(key):
            out[f"{key}_ratio"] = ours[key] / theirs[key]
    if ours_tokens is not None and theirs_tokens is not None:
        same = sum(a == b for a, b in zip(ours_tokens, theirs_tokens))
        prefix = [_common_prefix(a, b) / max(1, len(a)) for a, b in zip(ours_tokens, theirs_tokens)]
        out["greedy_identical_requests"] = f"{same}/{len(ours_tokens)}"
        out["greedy_mean_common_prefix_frac"] = sum(prefix) / max(1, len(prefix))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
