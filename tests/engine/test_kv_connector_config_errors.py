"""Bad KV connector settings fail at engine construction with a message naming the setting
(issue #44 and the fresh-user tryout): a quantized KV cache with a connector that cannot carry
its scales, an infinite / bool / non-numeric `kv_offloading_size`, one the host cannot
allocate, and a `kv_transfer_config` of the wrong type."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import create_engine_config
from pagedllm.worker.kv_connector.base import check_unquantized

P2P = {"kv_connector": "P2pShmConnector", "kv_role": "kv_consumer"}


@pytest.mark.parametrize("dtype", ["int8", "fp8", "fp8_e4m3"])
@pytest.mark.parametrize("connector", [dict(kv_offloading_size=0.01),
                                       dict(kv_transfer_config=P2P)])
def test_quantized_kv_cache_refused_with_a_connector(tiny_llama, dtype, connector):
    with pytest.raises(ValueError, match="kv_cache_dtype='(int8|fp8_e4m3)' cannot be combined"):
        create_engine_config(str(tiny_llama), kv_cache_dtype=dtype, **connector)
    with pytest.raises(ValueError, match="indexer_cache_dtype='int8'"):
        create_engine_config(str(tiny_llama), indexer_cache_dtype="int8", **connector)
    create_engine_config(str(tiny_llama), kv_cache_dtype=dtype)     # (fine without one)


def test_worker_check_sees_a_quantized_cache_by_its_dtype():
    """An int8 cache has the unquantized cache's 5-D shape: the dtype tells them apart."""
    shape = (2, 4, 16, 2, 8)
    check_unquantized("OffloadingConnector", {"l0": torch.zeros(shape, dtype=torch.float32)})
    for dtype in (torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="l0's KV cache is quantized"):
            check_unquantized("OffloadingConnector", {"l0": torch.zeros(shape, dtype=dtype)})


@pytest.mark.parametrize("size", [math.inf, float("1e400"), math.nan, True, "1", -1.0, 0])
def test_bad_offloading_sizes(tiny_llama, size):
    with pytest.raises(ValueError, match="kv_offloading_size must be a finite number of GiB"):
        create_engine_config(str(tiny_llama), kv_offloading_size=size)
    extra = {"kv_connector": "OffloadingConnector",
             "kv_connector_extra_config": {"kv_offloading_size": size}}
    with pytest.raises(ValueError, match="kv_transfer_config: kv_offloading_size must be"):
        create_engine_config(str(tiny_llama), kv_transfer_config=extra)


@pytest.mark.parametrize("config", [["OffloadingConnector"], '{"kv_connector": "X"}', 3])
def test_kv_transfer_config_of_the_wrong_type(tiny_llama, config):
    with pytest.raises(TypeError, match="kv_transfer_config must be a dict or a "
                                        "KVTransferConfig"):
        create_engine_config(str(tiny_llama), kv_transfer_config=config)


def test_unallocatable_tier_names_the_setting_and_bytes(tiny_llama):
    with pytest.raises(ValueError, match=r"kv_offloading_size asks for \d+ blocks = \d+ bytes "
                                         r"of host memory, which could not be allocated"):
        LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=8,
            kv_offloading_size=1_000_000)
