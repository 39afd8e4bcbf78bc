"""A fast look at a GGUF file's metadata keys, for start-up checks.

`gguf.GGUFReader` parses every metadata value into numpy objects and builds the tensor table:
seconds for a 50k-token vocabulary, tens of seconds for Gemma's 262k. A check that wants one key
(is there a `tokenizer.chat_template`?) reads the key/value section instead, skipping values it
does not want: the layout is the file format's own (ggml's docs/gguf.md: magic "GGUF", version,
tensor count, key/value count, then per key a length-prefixed name, a value type and the value;
arrays as element type, count, elements). The type codes come from the `gguf` package.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from gguf import GGUF_MAGIC, GGUFValueType

# Fixed-size scalar types: struct format (little-endian).
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}


def read_gguf_metadata(path: str | Path, keys: set[str]) -> dict[str, Any]:
    """The values of those of `keys` the file's metadata holds (scalars and strings as Python
    values; an array key maps to None, present but not read). Tensors are never read.

    Raises:
        ValueError: naming the file, when it is not a GGUF file (v2 or v3) or is truncated.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _scan(data, keys)
        except (struct.error, IndexError, ValueError) as e:
            raise ValueError(f"not a valid GGUF file: {path} ({e})") from None


def _scan(data: mmap.mmap, keys: set[str]) -> dict[str, Any]:
    magic, version = struct.unpack_from("<II", data, 0)
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"magic {magic:#x}, version {version}")
    (num_kv,) = struct.unpack_from("<Q", data, 16)
    offset, found = 24, {}
    for _ in range(num_kv):
        key, offset = _string(data, offset)
        (value_type,) = struct.unpack_from("<I", data, offset)
        offset += 4
        start = offset
        offset = _skip_value(data, offset, GGUFValueType(value_type))
        if key in keys:
            found[key] = _value(data, start, GGUFValueType(value_type))
    return found


def _string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 8 + length
    if end > len(data):
        raise ValueError("a string runs past the end of the file")
    return data[offset + 8:end].decode("utf-8", errors="replace"), end


def _skip_value(data: mmap.mmap, offset: int, value_type: GGUFValueType) -> int:
    if value_type in _SCALARS:
        return offset + struct.calcsize(_SCALARS[value_type])
    if value_type == GGUFValueType.STRING:
        (length,) = struct.unpack_from("<Q", data, offset)
        return offset + 8 + length
    element_type, count = struct.unpack_from("<IQ", data, offset)
    offset += 12
    element_type = GGUFValueType(element_type)
    if element_type in _SCALARS:
        return offset + count * struct.calcsize(_SCALARS[element_type])
    for _ in range(count):
        offset = _skip_value(data, offset, element_type)
    return offset


def _value(data: mmap.mmap, offset: int, value_type: GGUFValueType) -> Any:
    if value_type in _SCALARS:
        return struct.unpack_from(_SCALARS[value_type], data, offset)[0]
    if value_type == GGUFValueType.STRING:
        return _string(data, offset)[0]
    return None
