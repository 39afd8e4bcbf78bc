"""CUDA-graph policy and buffers on the CPU: capture sizes, padding of decode batches, the
persistent input buffers a graph reads; capture and replay themselves only on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.config import CudaGraphConfig
from pagedllm.worker.cuda_graph import (PAD_SLOT_ID, CudaGraphInputBuffers, CudaGraphRunner,
                                        cudagraph_batch_size, default_capture_sizes,
                                        pad_to_capture_size, resolve_capture_sizes)


def test_default_capture_sizes():
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(3) == (1, 2, 3)
    assert default_capture_sizes(8) == (1, 2, 4, 8)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = default_capture_sizes(128)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-1] == 128
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    sizes = default_capture_sizes(4096)
    assert sizes[-1] == 512 and 248 in sizes and 264 not in sizes and 272 in sizes
    with pytest.raises(ValueError, match="max_num_seqs"):
        default_capture_sizes(0)


@pytest.mark.parametrize("kwargs,match", [
    ({"cudagraph_mode": "FULL"}, "cudagraph_mode"),
    ({"cudagraph_capture_sizes": (1, 4, 2)}, "ascending"),
    ({"cudagraph_capture_sizes": (1, 2, 2)}, "ascending"),
    ({"cudagraph_capture_sizes": (0, 2)}, "positive"),
    ({"cudagraph_capture_sizes": (True, 2)}, "positive"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CudaGraphConfig(**kwargs)


def test_resolve_capture_sizes():
    assert resolve_capture_sizes(CudaGraphConfig(), 16, True) == (1, 2, 4, 8, 16)
    assert resolve_capture_sizes(CudaGraphConfig(enforce_eager=True), 16, True) == ()
    assert resolve_capture_sizes(CudaGraphConfig(cudagraph_mode="NONE"), 16, True) == ()
    assert resolve_capture_sizes(CudaGraphConfig(), 16, False) == ()
    config = CudaGraphConfig(cudagraph_capture_sizes=(1, 3, 32, 64))
    assert resolve_capture_sizes(config, 40, True) == (1, 3, 32)


def test_pad_to_capture_size_is_the_smallest_size_that_fits():
    sizes = default_capture_sizes(300)
    for n in range(1, 320):
        fits = [s for s in sizes if s >= n]
        assert pad_to_capture_size(n, sizes) == (min(fits) if fits else None)


def test_only_pure_decode_steps_replay():
    sizes = (1, 2, 4, 8)
    assert cudagraph_batch_size(sizes, num_reqs=3, num_tokens=3, max_query_len=1) == 4
    assert cudagraph_batch_size(sizes, num_reqs=8, num_tokens=8, max_query_len=1) == 8
    assert cudagraph_batch_size(sizes, num_reqs=9, num_tokens=9, max_query_len=1) is None
    assert cudagraph_batch_size(sizes, num_reqs=3, num_tokens=7, max_query_len=5) is None
    assert cudagraph_batch_size(sizes, num_reqs=0, num_tokens=0, max_query_len=0) is None
    assert cudagraph_batch_size((), num_reqs=1, num_tokens=1, max_query_len=1) is None


def _decode_common(seq_lens, block_size=4, width=None, rng=None, num_blocks=50):
    """A decode step's metadata on the CPU; distinct blocks per request (from 1..num_blocks-1)."""
    rng = rng or np.random.default_rng(0)
    num_reqs = len(seq_lens)
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    width = width or int(-(-seq_lens.max() // block_size))
    block_table = rng.permutation(np.arange(1, num_blocks))[:num_reqs * width]
    block_table = block_table.reshape(num_reqs, width).astype(np.int32)
    pos = seq_lens - 1
    slots = block_table[np.arange(num_reqs), pos // block_size].astype(np.int64) * block_size \
        + pos % block_size
    qsl = np.arange(num_reqs + 1, dtype=np.int32)
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens), seq_lens_cpu=seq_lens,
        block_table=torch.from_numpy(block_table), slot_mapping=torch.from_numpy(slots),
        num_reqs=num_reqs, num_actual_tokens=num_reqs, max_query_len=1,
        max_seq_len=int(seq_lens.max()), block_size=block_size)


def test_buffers_pad_a_decode_step():
    buffers = CudaGraphInputBuffers(max_num_seqs=8, max_num_blocks_per_req=6,
                                    device=torch.device("cpu"), num_kv_cache_groups=2)
    rng = np.random.default_rng(0)
    # A large step first, so the smaller one must overwrite its rows.
    big = [_decode_common([9, 3, 17, 5, 21, 2, 8], rng=rng)] * 2
    buffers.prepare(torch.arange(7) + 100, torch.arange(7) + 50, big, 8)
    commons = [_decode_common([5, 12, 3], width=4, rng=rng),
               _decode_common([5, 12, 3], width=3, rng=rng)]
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor([4, 11, 2])
    padded = buffers.prepare(ids, pos, commons, 4)
    assert len(padded) == 2
    for g, (p, c) in enumerate(zip(padded, commons)):
        assert p.num_reqs == p.num_actual_tokens == 4 and p.max_query_len == 1
        assert p.query_start_loc.tolist() == [0, 1, 2, 3, 4]
        assert p.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 4]
        assert p.seq_lens.tolist() == p.seq_lens_cpu.tolist() == [5, 12, 3, 1]
        assert p.max_seq_len == 12
        width = c.block_table.shape[1]
        assert torch.equal(p.block_table[:3, :width], c.block_table)
        assert not p.block_table[3].any()                         # padding reads block 0
        assert p.slot_mapping.tolist() == c.slot_mapping.tolist() + [PAD_SLOT_ID]
        # views of the persistent buffers: what a captured graph reads
        assert p.block_table.data_ptr() == buffers.block_tables[g].data_ptr()
        assert p.slot_mapping.data_ptr() == buffers.slot_mappings[g].data_ptr()
    assert buffers.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert buffers.positions[:4].tolist() == [4, 11, 2, 0]


def test_buffers_refuse_what_they_cannot_hold():
    buffers = CudaGraphInputBuffers(4, 3, torch.device("cpu"))
    decode = _decode_common([5, 9])
    with pytest.raises(ValueError, match="padded_size"):
        buffers.prepare(torch.zeros(2), torch.zeros(2), [decode], 1)
    with pytest.raises(ValueError, match="padded_size"):
        buffers.prepare(torch.zeros(2), torch.zeros(2), [decode], 5)
    with pytest.raises(ValueError, match="KV cache groups"):
        buffers.prepare(torch.zeros(2), torch.zeros(2), [decode, decode], 2)
    with pytest.raises(ValueError, match="blocks per request"):
        buffers.prepare(torch.zeros(2), torch.zeros(2), [_decode_common([5, 30])], 2)
    prefill = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3]), query_start_loc_cpu=np.array([0, 3]),
        seq_lens=torch.tensor([3]), seq_lens_cpu=np.array([3]),
        block_table=torch.ones(1, 1, dtype=torch.int32), slot_mapping=torch.arange(3),
        num_reqs=1, num_actual_tokens=3, max_query_len=3, max_seq_len=3, block_size=4)
    with pytest.raises(ValueError, match="not a decode step"):
        buffers.prepare(torch.zeros(3), torch.zeros(3), [prefill], 2)


def test_dummy_step_reads_and_writes_nothing():
    buffers = CudaGraphInputBuffers(4, 2, torch.device("cpu"))
    (common,) = buffers.prepare_dummy(3, block_size=16)
    assert common.num_reqs == 3 and common.seq_lens.tolist() == [1, 1, 1]
    assert common.slot_mapping.tolist() == [PAD_SLOT_ID] * 3 and not common.block_table.any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU guard")
def test_capture_needs_cuda():
    runner = CudaGraphRunner(CudaGraphInputBuffers(2, 2, torch.device("cpu")), (1, 2), 16)
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.capture(lambda size, commons: torch.zeros(size))
    with pytest.raises(KeyError, match="no CUDA graph"):
        runner.replay(1)


@pytest.mark.cuda
def test_capture_and_replay_attention_matches_eager():
    """triton_paged attention captured per size and replayed on later decode steps equals the
    same steps run eagerly (and writes the same KV)."""
    pytest.importorskip("triton")
    from pagedllm.attention.backends.triton_paged import TritonPagedBackend

    device = torch.device("cuda")
    heads, kv_heads, head_size, block_size, num_blocks = 4, 2, 64, 16, 64
    buffers = CudaGraphInputBuffers(8, 8, device)
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_size, device=device)
    q_buf = torch.zeros(8, heads, head_size, device=device)
    k_buf = torch.zeros(8, kv_heads, head_size, device=device)
    v_buf = torch.zeros(8, kv_heads, head_size, device=device)

    def forward(size, commons):
        return TritonPagedBackend.forward(q_buf[:size], k_buf[:size], v_buf[:size], kv_cache,
                                          TritonPagedBackend.build_metadata(commons[0]),
                                          head_size ** -0.5)

    runner = CudaGraphRunner(buffers, (1, 2, 4, 8), block_size)
    runner.capture(forward)
    assert not kv_cache.any()                        # capture wrote nothing (slots -1)
    rng = np.random.default_rng(0)
    for num_reqs in (1, 3, 5, 8):
        kv_cache.normal_()
        kv_cache[:, 0] = 0
        common = _decode_common(rng.integers(1, 100, num_reqs), block_size, rng=rng,
                                num_blocks=num_blocks)
        common = CommonAttentionMetadata(**{
            f: (getattr(common, f).to(device) if isinstance(getattr(common, f), torch.Tensor)
                else getattr(common, f)) for f in common.__dataclass_fields__})
        q = torch.randn(num_reqs, heads, head_size, device=device)
        k = torch.randn(num_reqs, kv_heads, head_size, device=device)
        v = torch.randn(num_reqs, kv_heads, head_size, device=device)
        eager_cache = kv_cache.clone()
        want = TritonPagedBackend.forward(q, k, v, eager_cache,
                                          TritonPagedBackend.build_metadata(common),
                                          head_size ** -0.5)
        size = cudagraph_batch_size(runner.capture_sizes, num_reqs, num_reqs, 1)
        q_buf[:num_reqs], k_buf[:num_reqs], v_buf[:num_reqs] = q, k, v
        buffers.prepare(torch.zeros(num_reqs, device=device),
                        torch.zeros(num_reqs, device=device), [common], size)
        got = runner.replay(size)[:num_reqs]
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(kv_cache, eager_cache)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_greedy_tokens_with_decode_graphs_equal_enforce_eager(tiny_checkpoints, arch):
    """End to end on a GPU: FULL_DECODE_ONLY (decode batches of 1, 3, 5 padded to 1, 4, 8;
    9 > 8 eager; gemma3 adds a sliding KV cache group) gives enforce_eager's greedy tokens."""
    pytest.importorskip("triton")
    from pagedllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    batches = [[torch.randint(3, 100, (int(n),), generator=gen).tolist()
                for n in torch.randint(2, 30, (size,), generator=gen)] for size in (1, 3, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(str(tiny_checkpoints[arch]), dtype="float32", kv_cache_memory_bytes=16 << 20,
                  max_num_seqs=16, cudagraph_mode="FULL_DECODE_ONLY", enforce_eager=eager,
                  cudagraph_capture_sizes=[1, 2, 4, 8])
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        assert runner.model.attention_layers()[0].backend.name == "triton_paged"
        assert (runner.graph_runner is None) == eager
        tokens[eager] = [[o.outputs[0].token_ids for o in llm.generate(b, params, use_tqdm=False)]
                         for b in batches]
        if not eager:
            assert runner.graph_runner.num_runs_by_size == {1: 7, 4: 7, 8: 7}
        del llm, runner
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
