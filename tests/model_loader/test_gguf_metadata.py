"""`read_gguf_metadata` (the fast key/value scan for start-up checks) against gguf's own reader."""

from __future__ import annotations

import pytest
from gguf import GGUFReader, GGUFValueType

from pagedllm.model_loader.gguf_metadata import read_gguf_metadata
from tests.fixtures.gguf_files import write_gguf


def test_every_key_reads_as_ggufs_reader_reads_it(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0",
                      extra_metadata={"test.int": 7, "test.float": 0.5, "test.text": "café"})
    # The reader also lists the header's counts as pseudo-keys "GGUF.*".
    fields = {k: f for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
    ours = read_gguf_metadata(path, set(fields) | {"no.such.key"})
    assert set(ours) == set(fields)
    for key, field in fields.items():
        if field.types[0] == GGUFValueType.ARRAY:
            assert ours[key] is None, key
        else:
            expected = field.contents()
            assert ours[key] == pytest.approx(expected) if isinstance(expected, float) \
                else ours[key] == expected, key
    assert ours["test.text"] == "café" and ours["test.int"] == 7
    assert "tokenizer.chat_template" in ours


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\xff" * 8)
    with pytest.raises(ValueError, match="not a valid GGUF file: .*x.gguf"):
        read_gguf_metadata(path, {"a"})
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 40)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf_metadata(path, {"a"})
