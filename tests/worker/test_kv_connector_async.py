"""The KV connectors' asynchronous worker side (worker/kv_connector/async_copy.py and the
per-layer seams of worker/kv_connector/base.py) on plain CPU tensors: transfers run in order
on the copy thread and a failure re-raises in whoever waits; async and sync connectors leave
the same bytes in the device cache and the host tier; loads start without blocking and each
layer waits for its own; a P/D producer's export loads
into a consumer's blocks either way; a step whose loads no layer waited for (every request
aborted) finishes them without a deadlock; a disk file that changed or vanished after it
was matched is a load error: its block is reported and zeroed, the step's other loads land,
and the next step runs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedllm.config import KVTransferConfig
from pagedllm.core.kv_connector.disk_tier import block_file, encode_block_file, write_block_file
from pagedllm.core.kv_connector.offloading import OffloadingMetadata
from pagedllm.core.kv_connector.p2p_shm import ExportSpec, LoadSpec, P2pShmMetadata
from pagedllm.core.kv_connector.p2p_transport import transfer_file, transfer_key
from pagedllm.worker.kv_connector.async_copy import CopyQueue
from pagedllm.worker.kv_connector.base import block_row_columns, finish_step, start_step
from pagedllm.worker.kv_connector.offloading import OffloadingConnectorWorker
from pagedllm.worker.kv_connector.p2p_shm import P2pShmConnectorWorker

LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"]
SHAPE = (2, 10, 4, 2, 8)   # [2, num_blocks, block_size, heads, head_size]


def _caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(SHAPE, generator=g) for name in LAYERS}


def _connector(caches, asynchronous: bool, disk_dir=None) -> OffloadingConnectorWorker:
    bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in caches.values())
    extra = {"kv_offloading_size": 8 * bytes_per_block / 2**30,
             "async_transfers": asynchronous}
    if disk_dir is not None:
        extra["kv_offloading_dir"] = str(disk_dir)
    return OffloadingConnectorWorker(extra, caches, bytes_per_block, torch.device("cpu"))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_copy_queue_order_and_errors(asynchronous):
    queue = CopyQueue(torch.device("cpu"), asynchronous)
    seen = []
    tickets = [queue.submit(lambda i=i: seen.append(i)) for i in range(20)]

    def fail():
        raise RuntimeError("bad block")
    bad = queue.submit(fail)
    after = queue.submit(lambda: seen.append("after"))
    for t in tickets:
        queue.wait(t)
    with pytest.raises(RuntimeError, match="bad block"):
        queue.wait(bad)
    queue.wait(after)   # (a failed transfer does not stop the queue)
    assert seen == list(range(20)) + ["after"]
    queue.shutdown()


def test_copy_thread_has_one_intra_op_thread_and_leaves_the_others_alone():
    before = torch.get_num_threads()
    queue = CopyQueue(torch.device("cpu"), True)
    assert queue._executor.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before
    with ThreadPoolExecutor(1) as fresh:   # (a thread started later: torch's default)
        assert fresh.submit(torch.get_num_threads).result() == before
    queue.shutdown()


def _step(conn, meta: OffloadingMetadata, caches) -> None:
    """One step: loads start, each layer waits for its own and saves after a (fake) write."""
    hooks = start_step(conn, meta, LAYERS)
    for name in LAYERS:
        hooks.wait_for_layer_load(name)
        caches[name][:, 9] += 1.0   # (the step's K/V write, into a block nobody transfers)
        hooks.save_kv_layer(name, caches[name])
    finish_step(hooks, caches)


def test_async_equals_sync_and_loads_start_without_blocking():
    results = []
    for asynchronous in (True, False):
        caches = _caches(0)
        conn = _connector(caches, asynchronous)
        # Step 1 stores blocks 1, 2 in slots 3, 5; step 2 loads them back into 6, 7 and stores
        # block 4 in slot 0.
        _step(conn, OffloadingMetadata(store_block_ids=[1, 2], store_slots=[3, 5]), caches)
        _step(conn, OffloadingMetadata(load_block_ids=[6, 7], load_slots=[3, 5],
                                       store_block_ids=[4], store_slots=[0]), caches)
        for cache in caches.values():
            assert torch.equal(cache[:, 6:8], cache[:, 1:3])
        results.append(({n: c.clone() for n, c in caches.items()},
                        {n: h.clone() for n, h in conn._host.items()}))
        conn.shutdown()
    (caches_a, host_a), (caches_s, host_s) = results
    assert all(torch.equal(caches_a[n], caches_s[n]) for n in LAYERS)
    assert all(torch.equal(host_a[n], host_s[n]) for n in LAYERS)

    # start_load_kv only queues: with the copy thread held, no block has landed when it
    # returns; each layer's wait then returns once its own load did.
    caches = _caches(1)
    conn = _connector(caches, True)
    _step(conn, OffloadingMetadata(store_block_ids=[1], store_slots=[2]), caches)
    gate = threading.Event()
    conn._queue.submit(gate.wait)
    hooks = start_step(conn, OffloadingMetadata(load_block_ids=[5], load_slots=[2]), LAYERS)
    assert not any(torch.equal(c[:, 5], c[:, 1]) for c in caches.values())
    gate.set()
    for name in LAYERS:
        hooks.wait_for_layer_load(name)
        assert torch.equal(caches[name][:, 5], caches[name][:, 1])
    finish_step(hooks, caches)
    conn.shutdown()


def test_unwaited_loads_finish_at_step_end_and_bad_files_are_reported(tmp_path):
    caches = _caches(2)
    conn = _connector(caches, True, tmp_path / "kv")
    _step(conn, OffloadingMetadata(store_block_ids=[1], store_slots=[0],
                                   disk_store_block_ids=[1], disk_store_hashes=[b"h1"]),
          caches)
    assert block_file(tmp_path / "kv", b"h1", 0).is_file()
    # A step whose requests were all aborted: its forward never ran, nothing waited for a
    # layer; the step's end finishes the loads (host slot and disk file) all the same.
    hooks = start_step(conn, OffloadingMetadata(load_block_ids=[3], load_slots=[0],
                                                disk_load_block_ids=[4],
                                                disk_load_hashes=[b"h1"]), LAYERS)
    finish_step(hooks, caches)
    for cache in caches.values():
        assert torch.equal(cache[:, 3], cache[:, 1]) and torch.equal(cache[:, 4], cache[:, 1])

    # The file rewritten (one payload byte flipped, another model's layout) or deleted after
    # the scheduler side matched it: never a wrong byte loaded, no raise; its block is zeros
    # and reported once (`get_block_ids_with_load_errors`), the step's other loads land.
    columns = block_row_columns(caches)
    assert list(columns.values())[-1][1] == conn.bytes_per_block
    _step(conn, OffloadingMetadata(disk_store_block_ids=[2], disk_store_hashes=[b"h2"]),
          caches)
    path = block_file(tmp_path / "kv", b"h1", 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    foreign = encode_block_file(b"h1", "another model", b"\0" * conn.bytes_per_block)
    for bad in (lambda: path.write_bytes(bytes(data)), lambda: write_block_file(path, foreign),
                path.unlink):
        bad()
        _step(conn, OffloadingMetadata(load_block_ids=[6], load_slots=[0],
                                       disk_load_block_ids=[5, 7],
                                       disk_load_hashes=[b"h1", b"h2"]), caches)
        assert conn.get_block_ids_with_load_errors() == {5}
        assert conn.get_block_ids_with_load_errors() == set()
        for cache in caches.values():
            assert not cache[:, 5].any()
            assert torch.equal(cache[:, 6], cache[:, 1]) and torch.equal(cache[:, 7], cache[:, 2])
            cache[:, 5:8] = -1.0
    _step(conn, OffloadingMetadata(load_block_ids=[6], load_slots=[0]), caches)
    for cache in caches.values():
        assert torch.equal(cache[:, 6], cache[:, 1])
    assert conn.get_block_ids_with_load_errors() == set()
    conn.shutdown()


@pytest.mark.parametrize("producer_async,consumer_async", [(True, False), (False, True)])
def test_p2p_export_then_load_per_layer(tmp_path, producer_async, consumer_async):
    """A producer exports its blocks 1-3; a consumer loads the file's last two blocks
    (first_block 1) into its blocks 6, 7, layer for layer, whichever side copies
    asynchronously; the consumer deletes the file after loading it."""
    def worker(role: str, asynchronous: bool, caches) -> P2pShmConnectorWorker:
        config = KVTransferConfig("P2pShmConnector", role, {"shm_dir": str(tmp_path),
                                                            "async_transfers": asynchronous})
        bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in caches.values())
        return P2pShmConnectorWorker(config, caches, bytes_per_block, torch.device("cpu"))
    sent, received = _caches(3), _caches(4)
    producer = worker("kv_producer", producer_async, sent)
    consumer = worker("kv_consumer", consumer_async, received)
    key = transfer_key("req-1")
    hooks = start_step(producer, P2pShmMetadata(exports=[ExportSpec(key, [1, 2, 3])]), LAYERS)
    for name in LAYERS:
        hooks.wait_for_layer_load(name)
        hooks.save_kv_layer(name, sent[name])
    finish_step(hooks, sent)
    path = transfer_file(tmp_path, producer.engine_id, key, 0)
    assert path.is_file()
    hooks = start_step(consumer, P2pShmMetadata(
        loads=[LoadSpec(producer.engine_id, key, 1, [6, 7])]), LAYERS)
    for name in LAYERS:
        hooks.wait_for_layer_load(name)
        assert torch.equal(received[name][:, 6:8], sent[name][:, 2:4])
    finish_step(hooks, received)
    assert not path.exists()
    producer.shutdown()
    consumer.shutdown()
