"""The P2pShmConnector's transport (docs/kv_connectors.md, "Prefill/decode disaggregation"):
control messages over ZeroMQ, block bytes in shared memory.

    decode (kv_consumer) engine core              prefill (kv_producer) engine core
    TransferClient.pull(key) ── DEALER ──────────► TransferServer (ROUTER, bound to kv_ip:kv_port)
                             ◄──────────────────── PullReply: ok, num_tokens, layouts | error
    decode workers read  <shm_dir>/pagedllm-kv-<engine_id>-<key>.r<rank>  (written by the
    prefill workers: disk_tier.py's file format, a JSON header and raw bytes) and delete it.

Every message is one msgpack frame decoded into a declared `msgspec.Struct` (never pickle), so a
peer can at worst make a decode fail. The server binds to loopback unless `kv_ip` says otherwise
and answers only messages whose TCP peer address is the configured `kv_peer_ip`. File names are
derived by each side from the engine id and a digest of the request id (`transfer_file`), never
taken from a message, so a peer cannot name a path. A pull hands the files over: the server
forgets them and the consumer deletes them after loading (or on abort). Files never pulled are
deleted after `transfer_ttl` seconds and at shutdown.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from pagedllm.core.kv_connector.disk_tier import MAGIC

logger = logging.getLogger(__name__)

_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class PullRequest(msgspec.Struct):
    """Consumer -> producer: hand over the exported KV of the request with digest `key`."""

    key: str
    engine_id: str   # the consumer's (for the producer's log)


class PullReply(msgspec.Struct):
    """Producer -> consumer: `ok` with what the files hold, else `error`."""

    ok: bool
    error: str = ""
    num_tokens: int = 0      # prompt tokens whose KV the files hold
    block_size: int = 0
    layouts: list[str] = []  # each rank's layout string (worker/kv_connector/base.py kv_layout)


def check_engine_id(engine_id: object, what: str) -> str:
    """`engine_id` if it is a safe file-name part (letters, digits, `_.-`, at most 64).

    Raises:
        ValueError: naming `what`.
    """
    if not isinstance(engine_id, str) or not _SAFE_ID.fullmatch(engine_id) \
            or engine_id.strip(".") == "":
        raise ValueError(f"{what} must be 1-64 letters, digits or _.- , got {engine_id!r}")
    return engine_id


def transfer_key(request_id: str) -> str:
    """The file-name digest of the producer's request id (32 hex digits)."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:32]


def transfer_file(shm_dir: Path, engine_id: str, key: str, rank: int) -> Path:
    """Where the producer's rank `rank` puts a request's blocks (`key` = `transfer_key`)."""
    return shm_dir / f"pagedllm-kv-{engine_id}-{key}.r{rank}"


def check_transfer_file(path: Path, key: str, layout: str) -> str | None:
    """None if `path` starts with a header for `key` and `layout` and has the size the header
    says (disk_tier.py's format; the payload is not read), else what is wrong."""
    return read_transfer_header(path, key, layout)[1]


def read_transfer_header(path: Path, key: str, layout: str) -> tuple[int, str | None]:
    """(the payload's byte offset in `path`, None) when `check_transfer_file` passes, else
    (0, what is wrong)."""
    try:
        with path.open("rb") as f:
            head = f.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) + 4 or not head.startswith(MAGIC):
                return 0, f"{path} is not a KV transfer file"
            (header_len,) = struct.unpack_from("<I", head, len(MAGIC))
            header = json.loads(f.read(header_len).decode())
            size = path.stat().st_size
    except FileNotFoundError:
        return 0, f"{path} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return 0, f"{path} cannot be read: {e}"
    if not isinstance(header, dict) or header.get("hash") != key:
        return 0, f"{path} holds another request's KV"
    if header.get("layout") != layout:
        return 0, (f"{path} has KV layout {header.get('layout')!r}, this rank needs "
                   f"{layout!r} (another model, dtype, block size or tensor-parallel size)")
    offset = len(MAGIC) + 4 + header_len
    payload_bytes = header.get("payload_bytes")
    if not isinstance(payload_bytes, int) or size != offset + payload_bytes:
        return 0, f"{path} is truncated"
    return offset, None


@dataclass
class _Offer:
    reply: PullReply
    files: list[Path]
    expires: float   # time.monotonic()


class TransferServer:
    """The producer's endpoint: answers `PullRequest`s from `peer_ip` for the requests
    `offer`ed, on a daemon thread.

    Args:
        host, port: where to bind (`kv_ip`, `kv_port`).
        peer_ip: the only TCP peer address answered (`kv_peer_ip`).
        ttl: seconds an offer waits for its pull before its files are deleted.

    Raises:
        ValueError: the address cannot be bound (naming it).
    """

    def __init__(self, host: str, port: int, peer_ip: str, ttl: float) -> None:
        self.peer_ip = peer_ip
        self.ttl = ttl
        self._offers: dict[str, _Offer] = {}
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._socket.close()
            self._ctx.term()
            raise ValueError(f"P2pShmConnector: cannot bind kv_ip:kv_port {host}:{port}: "
                             f"{e}") from None
        self._decoder = msgspec.msgpack.Decoder(PullRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-transfer-server",
                                        daemon=True)
        self._thread.start()

    def offer(self, key: str, reply: PullReply, files: list[Path]) -> None:
        with self._lock:
            self._offers[key] = _Offer(reply, files, time.monotonic() + self.ttl)

    def withdraw(self, files: list[Path]) -> None:
        """Delete files never offered (their request failed or was aborted)."""
        for path in files:
            path.unlink(missing_ok=True)

    def num_offers(self) -> int:
        with self._lock:
            return len(self._offers)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                self._handle(self._socket.recv_multipart(copy=False))
            self._expire()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        peer = frames[-1].get("Peer-Address")
        if peer != self.peer_ip:
            logger.warning("KV transfer: ignored a message from %s (only %s is accepted: "
                           "kv_peer_ip)", peer, self.peer_ip)
            return
        if len(frames) != 2:
            return
        try:
            msg = self._decoder.decode(frames[1].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("KV transfer: ignored a malformed message from %s: %s", peer, e)
            return
        with self._lock:
            offer = self._offers.pop(msg.key, None)
        reply = offer.reply if offer is not None else PullReply(
            False, f"the prefill instance holds no KV for this request (unknown, already "
                   f"pulled, or expired after {self.ttl:g} s)")
        self._socket.send_multipart([frames[0].bytes, self._encoder.encode(reply)])

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [k for k, o in self._offers.items() if o.expires < now]
            offers = [self._offers.pop(k) for k in expired]
        for offer in offers:
            self.withdraw(offer.files)

    def close(self) -> None:
        """Stop answering and delete the files of every offer not pulled."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()
        self._ctx.term()
        with self._lock:
            offers, self._offers = list(self._offers.values()), {}
        for offer in offers:
            self.withdraw(offer.files)


class TransferClient:
    """The consumer's side: one `pull` per request, each on its own short-lived socket (a
    dead peer leaves nothing queued behind)."""

    def __init__(self, host: str, port: int, engine_id: str, timeout: float) -> None:
        self.address = f"tcp://{host}:{port}"
        self.engine_id = engine_id
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._decoder = msgspec.msgpack.Decoder(PullReply)

    def pull(self, key: str) -> PullReply:
        """The producer's answer for `key`; a reply with `ok` False when it does not answer
        within `timeout` seconds or answers garbage."""
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(self.address)
            socket.send(msgspec.msgpack.encode(PullRequest(key, self.engine_id)))
            if not socket.poll(int(self.timeout * 1000)):
                return PullReply(False, f"the prefill instance at {self.address} did not "
                                        f"answer within {self.timeout:g} s (transfer_timeout); "
                                        "is it running?")
            try:
                return self._decoder.decode(socket.recv())
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return PullReply(False, f"malformed reply from {self.address}: {e}")
        finally:
            socket.close()

    def close(self) -> None:
        self._ctx.term()
