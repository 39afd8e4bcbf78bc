"""CpuPlatform's environment settings: bad values fail with a message naming the variable."""

from __future__ import annotations

import pytest
import torch

from pagedllm.platforms.cpu import CpuPlatform


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "99999"])
def test_bad_thread_counts_are_refused(monkeypatch, value):
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", value)
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_THREADS"):
        CpuPlatform().init_device()


def test_thread_count_override(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("PAGEDLLM_CPU_THREADS", "1")
    try:
        CpuPlatform().init_device()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan"])
def test_bad_kv_cache_space_is_refused(monkeypatch, value):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE"):
        CpuPlatform().kv_cache_budget_bytes(0.9)


def test_kv_cache_space_caps_the_budget(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.5")
    assert CpuPlatform().kv_cache_budget_bytes(0.9) <= 2**29


@pytest.mark.parametrize("rows", [1, 7, 40, 600])
def test_linear_float32_out_from_bf16_operands(rows):
    """The LM head's path: bf16 hidden and weight in, float32 logits out, without a bf16 rounding
    of the result (every row count: kernel, torch, and widened-GEMM regimes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    y = CpuPlatform().linear(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    torch.testing.assert_close(y, x.float() @ w.float().T, atol=1e-4, rtol=1e-4)
    assert CpuPlatform().linear(x, w).dtype == torch.bfloat16


def test_kv_cache_sized_by_need_not_by_the_memory_cap(tiny_llama):
    """Without an explicit budget the CPU cache holds what max_num_seqs requests of
    max_model_len tokens can use (not 4 GiB for a tiny model); an explicit budget is kept."""
    from pagedllm import LLM

    llm = LLM(str(tiny_llama), max_num_seqs=4, max_model_len=64, block_size=16)
    assert llm.llm_engine.engine_core.num_blocks == 1 + 4 * (64 // 16)
    big = LLM(str(tiny_llama), max_num_seqs=4, max_model_len=64, block_size=16,
              kv_cache_memory_bytes=64 << 20)
    assert big.llm_engine.engine_core.num_blocks > 1 + 4 * (64 // 16)


def test_init_device_says_what_it_chose_and_refuses_a_bad_binding(caplog, monkeypatch):
    import logging

    from pagedllm.config import ParallelConfig

    monkeypatch.delenv("PAGEDLLM_CPU_THREADS", raising=False)
    before = torch.get_num_threads()
    platform = CpuPlatform()
    try:
        with caplog.at_level(logging.INFO, logger="pagedllm.platforms.cpu"):
            platform.init_device()
        assert "CPU: " in caplog.text and "OpenMP waits" in caplog.text
        assert (platform.thread_governor is not None) == (torch.get_num_threads() > 1)
        with pytest.raises(ValueError, match="not allowed to this process"):
            platform.init_device(threads_bind="0-4095")
        with pytest.raises(ValueError, match=r"gives 1 CPU list\(s\) for 2 process\(es\)"):
            platform.init_device(0, 2, threads_bind="0")
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads_bind 'all'"):
        ParallelConfig(cpu_threads_bind="all")
    with pytest.raises(ValueError, match="cpu_reserved_cores"):
        ParallelConfig(cpu_reserved_cores=-1)
    # Refused at the config, before any worker starts: lists for another number of processes,
    # CPUs this process may not use.
    with pytest.raises(ValueError, match=r"1 CPU list\(s\) for the 2 process\(es\)"):
        ParallelConfig(tensor_parallel_size=2, cpu_threads_bind="0")
    with pytest.raises(ValueError, match=r"CPU\(s\) 4095 not allowed"):
        ParallelConfig(tensor_parallel_size=2, cpu_threads_bind="0|4095")
