"""The OffloadingConnector's disk tier (`kv_offloading_dir`): one file per block and rank, named by
the block's prefix hash, kept across engine restarts; its index (LRU, a byte budget) lives on the
scheduler side, the files are written and read by the workers.

File format (no pickle: a JSON header and raw bytes):

    b"PAGEDKV1" | header length (uint32 little-endian) | header (UTF-8 JSON) | payload
    header: {"hash": <hex>, "layout": <the rank's layout string>, "payload_bytes": n,
             "crc32": <zlib.crc32 of the payload>}
    payload: each layer's K and V of the block ([2, block_size, num_kv_heads, head_size]), in
             layer order, raw bytes of the KV cache dtype

A block is offered as a hit only after every rank's file passed `check_block_file` (magic, hash,
layout, size and checksum), so a corrupt, truncated or foreign file (another model, dtype or
block size) is a miss, never a crash or wrong output; the check runs when the block is matched,
just before the workers read it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"PAGEDKV1"
SUFFIX = ".kv"


def make_tier_folder(directory: str | Path) -> Path:
    """The disk tier's folder, created if absent.

    Raises:
        ValueError: naming kv_offloading_dir, when the path is a file or cannot be created.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_offloading_dir {str(path)!r} cannot be used as the disk tier's "
                         f"folder: {e.strerror or e}") from None
    return path


def block_file(directory: Path, block_hash: bytes, rank: int) -> Path:
    return directory / f"{block_hash.hex()}.r{rank}{SUFFIX}"


def encode_block_file(block_hash: bytes, layout: str, payload: bytes) -> bytes:
    """The file's bytes for `payload` (see the module docstring)."""
    header = json.dumps({"hash": block_hash.hex(), "layout": layout,
                         "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_block_file(data: bytes, block_hash: bytes, layout: str,
                      check_crc: bool = True) -> bytes | None:
    """The payload of a block file's bytes, or None when anything does not match (see the module
    docstring)."""
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        return None
    (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4 + header_len
    try:
        header = json.loads(data[len(MAGIC) + 4:start].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    payload = data[start:]
    if (header.get("hash") != block_hash.hex() or header.get("layout") != layout
            or header.get("payload_bytes") != len(payload)
            or (check_crc and header.get("crc32") != zlib.crc32(payload))):
        return None
    return payload


def write_block_file(path: Path, contents: bytes) -> None:
    """Write atomically (a temporary name, then rename): a crash leaves no half file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(contents)
    os.replace(tmp, path)


class DiskTierIndex:
    """Which block hashes the disk tier holds (LRU order, oldest first) within `capacity_bytes`.

    Args:
        directory: the tier's folder (created; files of an earlier run are indexed, oldest
            first by modification time).
        layouts: each rank's layout string (files must match them).
        capacity_bytes: the tier's budget; the oldest blocks' files are deleted past it.
    """

    def __init__(self, directory: str | Path, layouts: list[str], capacity_bytes: int) -> None:
        self.directory = make_tier_folder(directory)
        self.layouts = layouts
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._checked: set[bytes] = set()   # blocks whose files passed `check`
        self.used_bytes = 0
        found = []
        for path in self.directory.glob(f"*.r0{SUFFIX}"):
            try:
                block_hash = bytes.fromhex(path.name[:-len(f".r0{SUFFIX}")])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, block_hash, stat.st_size * len(layouts)))
        for _, block_hash, size in sorted(found):
            self._sizes[block_hash] = size
            self.used_bytes += size
        self._evict_over_budget()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, block_hash: bytes) -> None:
        self._sizes.move_to_end(block_hash)

    def add(self, block_hash: bytes, size: int, pinned: set[bytes]) -> int:
        """Index a block the workers are writing (`size`: bytes over all ranks); returns how
        many old blocks were evicted for it (never one of `pinned`: read or written this
        step)."""
        self._sizes[block_hash] = size
        self.used_bytes += size
        return self._evict_over_budget(pinned | {block_hash})

    def check(self, block_hash: bytes) -> bool:
        """Whether every rank's file of the block is intact (else the block is dropped). A
        block that passed once is not read again (a request waiting for device blocks asks at
        every step); the worker still checks the header and size when it loads."""
        if block_hash in self._checked:
            return True
        for rank, layout in enumerate(self.layouts):
            try:
                data = block_file(self.directory, block_hash, rank).read_bytes()
            except OSError:
                data = b""
            if decode_block_file(data, block_hash, layout) is None:
                logger.warning("KV disk tier: block file %s of rank %d is missing, corrupt or "
                               "from another model; treated as a miss", block_hash.hex(), rank)
                self.remove(block_hash)
                return False
        self._checked.add(block_hash)
        return True

    def remove(self, block_hash: bytes) -> None:
        self._checked.discard(block_hash)
        size = self._sizes.pop(block_hash, None)
        if size is not None:
            self.used_bytes -= size
        for rank in range(len(self.layouts)):
            block_file(self.directory, block_hash, rank).unlink(missing_ok=True)

    def clear(self) -> None:
        for block_hash in list(self._sizes):
            self.remove(block_hash)

    def _evict_over_budget(self, pinned: set[bytes] = frozenset()) -> int:
        evicted = 0
        while self.used_bytes > self.capacity_bytes:
            victim = next((h for h in self._sizes if h not in pinned), None)
            if victim is None:
                break
            self.remove(victim)
            evicted += 1
        return evicted
