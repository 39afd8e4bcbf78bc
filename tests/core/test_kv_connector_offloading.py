"""The OffloadingConnector's scheduler side alone (core/kv_connector/offloading.py), from plain
requests: full blocks are stored once by hash, a later request with the same prefix is matched
after its device hits and loads them, LRU eviction skips the step's pinned slots, the roles gate
loads and stores, and a reset forgets everything."""

from __future__ import annotations

import pytest

from pagedllm.config import KVTransferConfig
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.kv_connector.offloading import OffloadingConnectorScheduler
from pagedllm.core.request import Request
from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

BS = 4
HASHER = get_request_block_hasher(BS)


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), 4, HASHER)


def _admit(conn, request: Request, block_ids: list[int], num_device_hit_tokens: int = 0):
    """Admit and schedule the whole prompt in one step; the step's metadata."""
    external = conn.get_num_new_matched_tokens(request, num_device_hit_tokens)
    conn.update_state_after_alloc(request, block_ids, external)
    request.num_computed_tokens = request.num_tokens
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs.append(NewRequestData(request.request_id, request.prompt_token_ids,
                                                 [], request.sampling_params, (block_ids,),
                                                 num_device_hit_tokens + external))
    out.num_scheduled_tokens[request.request_id] = request.num_tokens
    return external, conn.build_connector_meta(out)


def test_store_then_match_and_load():
    conn = OffloadingConnectorScheduler(BS, num_slots=8)
    a = _request("a", list(range(10, 23)))             # 13 tokens: 3 full blocks
    external, meta = _admit(conn, a, [5, 6, 7, 8])
    assert external == 0 and meta.load_slots == []
    assert meta.store_block_ids == [5, 6, 7] and len(set(meta.store_slots)) == 3
    conn.request_finished(a, [5, 6, 7, 8])

    b = _request("b", list(range(10, 23)) + [99])       # same prefix, 14 tokens
    external, meta = _admit(conn, b, [1, 2, 3, 4])
    assert external == 12
    assert meta.load_block_ids == [1, 2, 3]
    assert meta.store_slots == []                       # (its blocks are in the tier already)
    # After one device-hit block, the tier supplies the next two.
    c = _request("c", list(range(10, 23)))
    assert conn.get_num_new_matched_tokens(c, 4) == 8
    # At most num_tokens - 1 tokens: a 12-token prompt gets 2 blocks, not 3.
    assert conn.get_num_new_matched_tokens(_request("d", list(range(10, 22))), 0) == 8
    stats = conn.stats()
    assert (stats.stored_blocks, stats.loaded_blocks, stats.hits) == (3, 3, 3)


def test_lru_eviction_keeps_recently_used():
    conn = OffloadingConnectorScheduler(BS, num_slots=2)
    _admit(conn, _request("a", [1] * 4 + [2]), [1, 2])    # block A
    _admit(conn, _request("b", [3] * 4 + [2]), [3, 4])    # block B
    assert conn.get_num_new_matched_tokens(_request("a2", [1] * 4 + [5]), 0) == 4
    _admit(conn, _request("a3", [1] * 4 + [6]), [5, 6])   # loads A: A is now the most recent
    _, meta = _admit(conn, _request("c", [7] * 4 + [2]), [7, 8])   # C evicts B (LRU)
    assert meta.store_block_ids == [7]
    assert conn.get_num_new_matched_tokens(_request("b2", [3] * 4 + [2]), 0) == 0
    assert conn.get_num_new_matched_tokens(_request("a4", [1] * 4 + [2]), 0) == 4
    assert conn.stats().evicted_blocks == 1


def test_pinned_slots_are_not_evicted_in_their_step():
    conn = OffloadingConnectorScheduler(BS, num_slots=1)
    # Two full blocks in one step with one slot: the second waits (the first is pinned).
    _, meta = _admit(conn, _request("a", [1] * 4 + [2] * 4 + [3]), [1, 2, 3])
    assert meta.store_block_ids == [1]


def test_roles_and_reset():
    producer = OffloadingConnectorScheduler(BS, 4, "kv_producer")
    _, meta = _admit(producer, _request("a", [1] * 9), [1, 2, 3])
    assert meta.store_block_ids == [1, 2]
    assert producer.get_num_new_matched_tokens(_request("b", [1] * 9), 0) == 0
    consumer = OffloadingConnectorScheduler(BS, 4, "kv_consumer")
    _, meta = _admit(consumer, _request("a", [1] * 9), [1, 2, 3])
    assert meta.store_block_ids == []
    both = OffloadingConnectorScheduler(BS, 4)
    _admit(both, _request("a", [1] * 9), [1, 2, 3])
    both.reset_cache()
    assert both.get_num_new_matched_tokens(_request("b", [1] * 9), 0) == 0


@pytest.mark.parametrize("values, message", [
    ({"kv_connector": "NixlConnector"}, "unknown kv_connector 'NixlConnector'"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_sender"}, "kv_role must be one of"),
    ({"kv_role": "kv_both"}, "kv_connector is required"),
    ({"kv_connector": "OffloadingConnector", "kv_buffer_size": 1},
     r"unknown keys \['kv_buffer_size'\]"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"kv_offloading_size": 1, "cpu_bytes": 2}},
     r"unknown kv_connector_extra_config keys \['cpu_bytes'\] for OffloadingConnector"),
])
def test_transfer_config_errors(values, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_dict(values)


def test_disk_tier_folder_that_is_a_file_is_refused_by_name(tmp_path):
    from pagedllm.core.kv_connector.disk_tier import make_tier_folder

    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="kv_offloading_dir .*afile.* cannot be used"):
        make_tier_folder(a_file)
    assert make_tier_folder(tmp_path / "new" / "kv").is_dir()
