"""The model runner's decode-graph dispatch on the CPU: pure decode steps go through a
`CudaGraphRunner(replay_eagerly=True)` (real persistent buffers, padding to the capture sizes
[1, 2, 4, 8], slot -1 for padded rows, slicing of the real rows; only capture/replay replaced),
every other step (mixed prefill/decode, speculative verification, more than 8 requests) runs
eagerly, and greedy tokens equal the plain eager runner.

Padded rows write to slot -1, which only the `triton_paged` backend takes (the one that is
captured on CUDA); without a GPU its kernels run in triton's interpreter, imported here with
TRITON_INTERPRET=1 as in tests/attention/test_triton_paged.py (the module is skipped when triton
was already imported in this process without it).
"""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CAPTURE_SIZES = (1, 2, 4, 8)


def _import_kernels_interpreted() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        modules = [importlib.import_module(f"pagedllm.attention.ops.{n}")
                   for n in ("triton_unified_attention", "triton_reshape_and_cache")]
        # The first launch imports more of triton under the setting (see test_triton_paged.py).
        cache = torch.zeros(1, 1, 1, 1, device=DEVICE)
        modules[1].reshape_and_cache(cache[0], cache[0], cache, cache,
                                     torch.zeros(1, dtype=torch.int64, device=DEVICE))
    if DEVICE.type == "cpu" and not (isinstance(triton.language.zeros, InterpretedFunction)
                                     and all(m.INTERPRETED for m in modules)):
        pytest.skip("triton was imported in this process before without TRITON_INTERPRET=1; run "
                    "this module in its own process", allow_module_level=True)


_import_kernels_interpreted()

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.core.sched_output import NewRequestData, SchedulerOutput  # noqa: E402
from pagedllm.worker.cuda_graph import CudaGraphRunner  # noqa: E402


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton_paged")
        # Prefix caching off: the hand-made steps below write KV into blocks the scheduler does
        # not know about.
        yield LLM(str(tiny_checkpoints["llama"]), dtype="float32",
                  kv_cache_memory_bytes=4 << 20, max_num_seqs=16, max_num_batched_tokens=64,
                  enable_prefix_caching=False, cudagraph_mode="NONE")


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _use_eager_graph_runner(runner) -> CudaGraphRunner:
    graph_runner = CudaGraphRunner(runner.new_graph_input_buffers(), CAPTURE_SIZES,
                                   runner.block_size, replay_eagerly=True)
    runner.set_graph_runner(graph_runner)
    return graph_runner


def _greedy(llm, prompts, max_tokens=3):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts(n, seed=0, lo=2, hi=12):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 100, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.mark.slow
def test_padded_decode_steps_give_the_eager_tokens(llm):
    """Batches of 1, 3, 5 and 9 requests: decode steps pad to 1, 4, 8 and (9 > 8) run eagerly."""
    runner = _runner(llm)
    prompts = {n: _prompts(n, seed=n, hi=6) for n in (1, 3, 5, 9)}
    runner.graph_runner = None
    want = {n: _greedy(llm, p) for n, p in prompts.items()}
    graph_runner = _use_eager_graph_runner(runner)
    try:
        got = {n: _greedy(llm, p) for n, p in prompts.items()}
    finally:
        runner.graph_runner = None
    assert got == want
    # 2 decode steps per batch (the prefill step samples the first token).
    assert graph_runner.num_runs_by_size == {1: 2, 4: 2, 8: 2}


@pytest.mark.slow
def test_mixed_steps_run_eagerly_and_give_the_eager_tokens(llm):
    """A 40-token prompt chunked by the 64-token budget next to decoding requests: mixed steps
    run eagerly, the pure decode steps around them replay; tokens are those of the eager
    runner."""
    runner = _runner(llm)
    prompts = _prompts(3, seed=7) + _prompts(2, seed=8, lo=90, hi=100)
    runner.graph_runner = None
    want = _greedy(llm, prompts, max_tokens=6)
    graph_runner = _use_eager_graph_runner(runner)
    try:
        got = _greedy(llm, prompts, max_tokens=6)
    finally:
        runner.graph_runner = None
    assert got == want
    assert sum(graph_runner.num_runs_by_size.values()) >= 1


def _step(runner, reqs, num_scheduled, spec_tokens=None):
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = reqs
    so.num_scheduled_tokens = dict(zip([r.req_id for r in reqs], num_scheduled))
    so.total_num_scheduled_tokens = sum(num_scheduled)
    so.scheduled_spec_decode_tokens = spec_tokens or {}
    runner.execute_model(so)
    logits = runner._pending.logits.clone()
    runner.sample_tokens()
    for r in reqs:
        runner.states.remove_request(r.req_id)
    return logits


def _requests(runner, lengths, computed, tag):
    """New requests of `lengths` tokens with `computed` of them in the cache (blocks from 1)."""
    bs, groups = runner.block_size, len(runner.kv_cache_windows)
    reqs, next_block = [], 1
    for i, (n, c) in enumerate(zip(lengths, computed)):
        nb = -(-(n + 4) // bs)
        blocks = list(range(next_block, next_block + nb))
        next_block += nb
        reqs.append(NewRequestData(f"{tag}{i}", list(range(5, 5 + n)), [], SamplingParams(
            temperature=0.0), (blocks,) * groups, c))
    return reqs


@pytest.mark.parametrize("kind", ["decode", "mixed", "spec",
                                  pytest.param("spec_without_drafts", marks=pytest.mark.slow)])
def test_dispatch_by_step_kind(llm, kind):
    """Only pure decode steps (one query token per request, no drafts) take the graph runner;
    its logits equal the eager forward's."""
    runner = _runner(llm)
    lengths = [7, 20, 3]
    if kind == "decode":
        computed, scheduled, spec = [6, 19, 2], [1, 1, 1], None
    elif kind == "mixed":
        computed, scheduled, spec = [6, 0, 2], [1, 20, 1], None
    elif kind == "spec":
        computed, scheduled = [4, 17, 2], [3, 3, 1]
        spec = {"k0": [9, 10], "k1": [24, 25]}
    else:
        computed, scheduled = [6, 19, 2], [1, 1, 1]
        spec = {"k0": [], "k1": [], "k2": []}
    if kind.startswith("spec"):
        # The drafts sit after the request's tokens: the prompt ends before them.
        lengths = [c + s - len(spec.get(f"k{i}", [])) for i, (c, s)
                   in enumerate(zip(computed, scheduled))]
    # The "computed" tokens' KV was never written: read zeros, not whatever an earlier test of
    # this process left in the reused memory (NaNs there made both runs NaN).
    for cache in runner.kv_caches:
        cache.zero_()
    runner.graph_runner = None
    want = _step(runner, _requests(runner, lengths, computed, "k"), scheduled, spec)
    graph_runner = _use_eager_graph_runner(runner)
    try:
        got = _step(runner, _requests(runner, lengths, computed, "k"), scheduled, spec)
    finally:
        runner.graph_runner = None
    expected_runs = {4: 1} if kind == "decode" else {}
    assert graph_runner.num_runs_by_size == expected_runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
