"""The P2pShmConnector's transport alone (no engine): a pull hands an offer over once; the
server answers only its configured peer, survives garbage, and deletes files nobody pulled
(after transfer_ttl, and at close); transfer files are checked before loading."""

from __future__ import annotations

import socket
import time

import zmq

from pagedllm.core.kv_connector.disk_tier import encode_block_file
from pagedllm.core.kv_connector.p2p_transport import (PullReply, TransferClient, TransferServer,
                                                      check_transfer_file, transfer_key)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pull_hands_an_offer_over_once(tmp_path):
    port = _port()
    server = TransferServer("127.0.0.1", port, "127.0.0.1", ttl=60)
    client = TransferClient("127.0.0.1", port, "decode", timeout=5)
    try:
        kept = tmp_path / "kept"
        kept.write_bytes(b"x")
        server.offer("k1", PullReply(True, num_tokens=7, block_size=16, layouts=["L"]), [kept])
        # Garbage first: ignored, the server goes on.
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as raw:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(f"tcp://127.0.0.1:{port}")
            raw.send(b"\xc1 not msgpack")
            assert not raw.poll(200)
        reply = client.pull("k1")
        assert (reply.ok, reply.num_tokens, reply.layouts) == (True, 7, ["L"])
        again = client.pull("k1")
        assert not again.ok and "holds no KV for this request" in again.error
        assert kept.exists()   # (handed over: the consumer deletes it, not the server)
    finally:
        server.close()
        client.close()


def test_only_the_configured_peer_is_answered(tmp_path):
    port = _port()
    server = TransferServer("127.0.0.1", port, "10.1.2.3", ttl=60)
    client = TransferClient("127.0.0.1", port, "decode", timeout=0.5)
    try:
        server.offer("k1", PullReply(True), [])
        reply = client.pull("k1")
        assert not reply.ok and "did not answer within 0.5 s" in reply.error
        assert server.num_offers() == 1
    finally:
        server.close()
        client.close()


def test_unpulled_files_are_deleted_after_ttl_and_at_close(tmp_path):
    server = TransferServer("127.0.0.1", _port(), "127.0.0.1", ttl=0.2)
    stale, late = tmp_path / "stale", tmp_path / "late"
    stale.write_bytes(b"x")
    server.offer("a", PullReply(True), [stale])
    deadline = time.monotonic() + 5
    while stale.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stale.exists() and server.num_offers() == 0
    server.ttl = 60
    late.write_bytes(b"x")
    server.offer("b", PullReply(True), [late])
    server.close()
    assert not late.exists()


def test_transfer_file_checks(tmp_path):
    key = transfer_key("req-1")
    path = tmp_path / "f"
    path.write_bytes(encode_block_file(bytes.fromhex(key), "L0", b"\0" * 64))
    assert check_transfer_file(path, key, "L0") is None
    assert "another request" in check_transfer_file(path, transfer_key("req-2"), "L0")
    assert "layout" in check_transfer_file(path, key, "L1")
    path.write_bytes(path.read_bytes()[:-1])
    assert "truncated" in check_transfer_file(path, key, "L0")
    assert "missing" in check_transfer_file(tmp_path / "none", key, "L0")
    path.write_bytes(b"garbage")
    assert "not a KV transfer file" in check_transfer_file(path, key, "L0")
